//! A tensor moved off the device into host memory while the device needs the room, and brought
//! back ahead of its next use (the runner's layer boundaries under a plan with `offload`).
//!
//! On CUDA the copies run on a second stream into pinned memory (`cuda::offload`), ordered by
//! events, so neither the host nor the compute stream waits for a copy that has had time to
//! finish. On the CPU the values move into a separate host-side store and back: the same
//! sequence of calls, the same values, which is what the CPU tests of offloaded runs check.

use super::{cuda, DType, Device, Storage, Tensor};
use anyhow::Result;

/// A tensor's values in host memory (`Tensor::offload`).
pub struct Offloaded {
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    store: HostStore,
}

enum HostStore {
    Cpu(Vec<f32>),
    Cuda(cuda::HostCopy),
}

/// An offloaded tensor on its way back to the device (`Offloaded::prefetch`).
pub struct Prefetched {
    state: PrefetchState,
}

enum PrefetchState {
    Ready(Tensor),
    Cuda(cuda::Fetched),
}

impl Tensor {
    /// Moves this tensor's values to host memory. On CUDA the copy is queued behind the work
    /// that produced the tensor, and the device buffer is released by `Offloaded::settle`.
    pub fn offload(self) -> Result<Offloaded> {
        let shape = self.shape.clone();
        let dtype = self.dtype;
        let device = self.device.clone();
        let store = match &device {
            Device::Cpu => HostStore::Cpu(self.as_cpu()?.to_vec()),
            Device::Cuda(c) => HostStore::Cuda(c.offload(self)?),
        };
        Ok(Offloaded {
            shape,
            dtype,
            device,
            store,
        })
    }
}

impl Offloaded {
    /// Host bytes held.
    pub fn bytes(&self) -> usize {
        match &self.store {
            HostStore::Cpu(v) => v.len() * 4,
            HostStore::Cuda(h) => h.bytes(),
        }
    }

    /// Releases the device copy once the copy to host has run (CUDA: the compute stream waits
    /// for it on the device; nothing to do on the CPU).
    pub fn settle(&mut self) -> Result<()> {
        match &mut self.store {
            HostStore::Cpu(_) => Ok(()),
            HostStore::Cuda(h) => h.settle(),
        }
    }

    /// The tensor on the device now: its device copy where that has not been let go
    /// (`settle`), which spares the round trip, else a fetch waited for.
    pub fn into_device(mut self) -> Result<Tensor> {
        if let HostStore::Cuda(h) = &mut self.store {
            if let Some(t) = h.reclaim()? {
                return Ok(t);
            }
        }
        self.prefetch()?.wait()
    }

    /// Starts bringing the values back; `Prefetched::wait` hands out the device tensor. Work
    /// queued in between overlaps the copy.
    pub fn prefetch(&self) -> Result<Prefetched> {
        let state = match (&self.store, &self.device) {
            (HostStore::Cpu(v), _) => PrefetchState::Ready(Tensor::from_parts(
                self.shape.clone(),
                self.dtype,
                Device::Cpu,
                Storage::Cpu(v.clone()),
            )),
            (HostStore::Cuda(h), Device::Cuda(c)) => {
                PrefetchState::Cuda(c.fetch(h, &self.shape, self.dtype)?)
            }
            (HostStore::Cuda(_), Device::Cpu) => unreachable!("a CUDA copy of a CPU tensor"),
        };
        Ok(Prefetched { state })
    }
}

impl Prefetched {
    /// The tensor, ordered after its copy.
    pub fn wait(self) -> Result<Tensor> {
        match self.state {
            PrefetchState::Ready(t) => Ok(t),
            PrefetchState::Cuda(f) => f.wait(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_tensor_comes_back_bit_for_bit() {
        let v: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() / 3.0).collect();
        let t = Tensor::cpu(v.clone(), &[4, 6]).unwrap();
        let mut h = t.offload().unwrap();
        assert_eq!(h.bytes(), 24 * 4);
        h.settle().unwrap();
        let back = h.prefetch().unwrap().wait().unwrap();
        assert_eq!(back.shape(), &[4, 6]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.to_vec().unwrap()), bits(&v));
        // A second fetch of the same store gives the same values, and so does taking it back.
        let again = h.prefetch().unwrap().wait().unwrap();
        assert_eq!(bits(&again.to_vec().unwrap()), bits(&v));
        let back = h.into_device().unwrap();
        assert_eq!(back.shape(), &[4, 6]);
        assert_eq!(bits(&back.to_vec().unwrap()), bits(&v));
    }
}
