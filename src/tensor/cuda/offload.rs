//! Host offload: a device buffer copied to pinned host memory on a second stream (the copy
//! lane) while the compute stream goes on, and copied back ahead of its use.
//!
//! Ordering is by events only, so the host never waits:
//! - to host: an event on the compute stream after the producer; the lane waits for it, copies,
//!   and records `done`. The device source stays alive until `HostCopy::settle`, which makes the
//!   compute stream wait for `done` before the source's free (stream-ordered) can reuse it.
//! - back: the buffer is allocated on the compute stream, an event there lets the lane start the
//!   copy, and `Fetched::wait` makes the compute stream wait for the copy's `ready` event. The
//!   compute work queued between the prefetch and the wait overlaps the copy.
//!
//! All copies run on the one lane, in order, so a pinned buffer handed back to the pool can be
//! reused by the next copy without a wait; the pool frees buffers only after the lane is idle.

use super::*;

/// The capacity of a pinned buffer for `bytes`: at least 1 MiB, rounded up to an eighth of its
/// octave (at most 12.5% more), so that passes of nearby lengths reuse the buffers.
fn pinned_capacity(bytes: usize) -> usize {
    super::eighth_octave_up(bytes.max(1 << 20) as u64) as usize
}

/// The copy lane: its stream and the pool of pinned host buffers (created on first use).
#[derive(Default)]
pub(super) struct Lane {
    state: Mutex<Option<LaneState>>,
}

struct LaneState {
    stream: Arc<CudaStream>,
    /// Idle pinned buffers `(pointer, capacity)`.
    idle: Vec<(usize, usize)>,
    /// Bytes of pinned memory held (idle and in use).
    held: usize,
}

impl Lane {
    /// Synchronises the lane and frees every idle pinned buffer (the backend's teardown; buffers
    /// still in use are freed by their `HostCopy`'s drop, which returns them here first).
    pub(super) fn shut_down(&self) {
        if let Some(s) = self.state.lock().unwrap().take() {
            let _ = s.stream.synchronize();
            for (p, _) in s.idle {
                // SAFETY: pinned buffers of this lane; the lane is idle.
                let _ = unsafe { drv::free_host(p as *mut c_void) };
            }
        }
    }
}

/// An event of the backend's context, destroyed on drop.
struct Event(sys::CUevent);

impl Event {
    fn record_on(stream: sys::CUstream) -> Result<Event> {
        let e = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| anyhow!("cuda: event: {e:?}"))?;
        // SAFETY: a live event and stream of this context.
        unsafe { drv::event::record(e, stream) }.map_err(|e| anyhow!("cuda: event: {e:?}"))?;
        Ok(Event(e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroying a recorded event is deferred by the driver until it completes.
        let _ = unsafe { drv::event::destroy(self.0) };
    }
}

/// `stream` waits (on the device) for `event`.
fn wait(stream: sys::CUstream, event: &Event) -> Result<()> {
    // SAFETY: a live stream and a recorded event of this context.
    unsafe {
        drv::stream::wait_event(
            stream,
            event.0,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(|e| anyhow!("cuda: stream wait: {e:?}"))
}

/// A tensor's bytes in pinned host memory (`CudaBackend::offload`).
pub struct HostCopy {
    inner: Arc<Inner>,
    ptr: usize,
    cap: usize,
    bytes: usize,
    /// The device tensor being copied and the copy's completion, until `settle`.
    source: Option<(Tensor, Event)>,
}

impl HostCopy {
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Lets the device source go once its copy is done: the compute stream waits for the copy
    /// (on the device; the host does not wait), then the source is freed in stream order.
    pub fn settle(&mut self) -> Result<()> {
        drop(self.reclaim()?);
        Ok(())
    }

    /// The device source, if it has not been let go yet (`settle`), ordered after its copy to
    /// host (which reads it): the device tensor back without a copy.
    pub fn reclaim(&mut self) -> Result<Option<Tensor>> {
        match self.source.take() {
            Some((src, done)) => {
                self.inner.bind()?;
                wait(self.inner.cu_stream(), &done)?;
                Ok(Some(src))
            }
            None => Ok(None),
        }
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        let _ = self.settle();
        if let Some(s) = self.inner.offload.state.lock().unwrap().as_mut() {
            // Later copies on the lane are ordered after any copy still reading this buffer.
            s.idle.push((self.ptr, self.cap));
        }
    }
}

/// A tensor being copied back to the device (`CudaBackend::fetch`); `wait` hands it out.
pub struct Fetched {
    tensor: Tensor,
    ready: Event,
    inner: Arc<Inner>,
}

impl Fetched {
    /// The tensor, once the compute stream has been told to wait for its copy.
    pub fn wait(self) -> Result<Tensor> {
        self.inner.bind()?;
        wait(self.inner.cu_stream(), &self.ready)?;
        Ok(self.tensor)
    }
}

impl CudaBackend {
    /// A pinned buffer of at least `bytes` from the pool, the lane's stream with it.
    fn pinned(&self, bytes: usize) -> Result<(usize, usize, sys::CUstream)> {
        let mut guard = self.inner.offload.state.lock().unwrap();
        if guard.is_none() {
            let stream = self
                .inner
                .ctx
                .new_stream()
                .map_err(|e| anyhow!("cuda: creating the copy stream: {e:?}"))?;
            *guard = Some(LaneState {
                stream,
                idle: Vec::new(),
                held: 0,
            });
        }
        let s = guard.as_mut().expect("the lane was just created");
        let lane = s.stream.cu_stream();
        // The smallest idle buffer that holds `bytes`.
        let best = (0..s.idle.len())
            .filter(|&i| s.idle[i].1 >= bytes)
            .min_by_key(|&i| s.idle[i].1);
        if let Some(i) = best {
            let (p, cap) = s.idle.swap_remove(i);
            return Ok((p, cap, lane));
        }
        // None fits: the idle ones are too small for this pass; hand them back first (after the
        // lane is idle) so pinned memory stays near what one pass holds.
        if !s.idle.is_empty() {
            s.stream
                .synchronize()
                .map_err(|e| anyhow!("cuda: copy stream sync: {e:?}"))?;
            for (p, cap) in s.idle.drain(..) {
                // SAFETY: an idle pinned buffer of this lane; the lane is idle.
                let _ = unsafe { drv::free_host(p as *mut c_void) };
                s.held -= cap;
            }
        }
        let cap = pinned_capacity(bytes);
        // SAFETY: a plain pinned allocation, freed by the lane.
        // Not reported as the device's out-of-memory error (which the trainer answers with a
        // smaller device plan, and that would offload as much or more): host memory ran out.
        let p = unsafe { drv::malloc_host(cap, 0) }.map_err(|e| {
            let code = format!("{e:?}").replace("CUDA_ERROR_OUT_OF_MEMORY", "out of host memory");
            anyhow!(
                "cuda: pinning {:.2} GiB of host memory for offload ({:.2} GiB already pinned) \
                 failed: {code}; set `offload = false`, or free host memory",
                cap as f64 / (1u64 << 30) as f64,
                s.held as f64 / (1u64 << 30) as f64
            )
        })? as usize;
        s.held += cap;
        Ok((p, cap, lane))
    }

    /// Starts copying `t` to pinned host memory; `t` stays on the device until the copy's
    /// `settle` (or drop).
    pub fn offload(&self, t: Tensor) -> Result<HostCopy> {
        self.inner.bind()?;
        let bytes = t.numel() * t.dtype().size();
        let (ptr, cap, lane) = self.pinned(bytes)?;
        let produced = Event::record_on(self.inner.cu_stream())?;
        wait(lane, &produced)?;
        if bytes > 0 {
            // SAFETY: `ptr` is pinned memory of `cap >= bytes` bytes that no pending copy writes
            // (copies on the lane are in order); the source lives until `done` has passed.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(ptr as *mut c_void, cuda_ptr(&t)?, bytes, lane)
                    .result()
                    .map_err(|e| anyhow!("cuda: offload copy: {e:?}"))?;
            }
        }
        let done = Event::record_on(lane)?;
        Ok(HostCopy {
            inner: self.inner.clone(),
            ptr,
            cap,
            bytes,
            source: Some((t, done)),
        })
    }

    /// Starts copying `h` back into a new device tensor of `shape` and `dtype`.
    pub fn fetch(&self, h: &HostCopy, shape: &[usize], dtype: DType) -> Result<Fetched> {
        let t = self.empty(shape, dtype)?;
        ensure!(
            t.numel() * dtype.size() == h.bytes,
            "fetch: shape and bytes differ"
        );
        let lane = {
            let guard = self.inner.offload.state.lock().unwrap();
            guard
                .as_ref()
                .expect("a host copy's lane")
                .stream
                .cu_stream()
        };
        let allocated = Event::record_on(self.inner.cu_stream())?;
        wait(lane, &allocated)?;
        if h.bytes > 0 {
            // SAFETY: the destination is a live allocation of `h.bytes`; the pinned source holds
            // the offload's bytes (its copy ran earlier on the same lane).
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(cuda_ptr(&t)?, h.ptr as *const c_void, h.bytes, lane)
                    .result()
                    .map_err(|e| anyhow!("cuda: prefetch copy: {e:?}"))?;
            }
        }
        let ready = Event::record_on(lane)?;
        Ok(Fetched {
            tensor: t,
            ready,
            inner: self.inner.clone(),
        })
    }

    /// Bytes of pinned host memory the offload lane holds.
    pub fn pinned_bytes(&self) -> usize {
        self.inner
            .offload
            .state
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |s| s.held)
    }
}

#[cfg(test)]
mod tests {
    use super::pinned_capacity;

    #[test]
    fn pinned_buffers_are_at_least_a_mib_and_at_most_an_eighth_over() {
        let mib = 1usize << 20;
        assert_eq!(pinned_capacity(0), mib);
        assert_eq!(pinned_capacity(200_000), mib);
        // llama8b at 18432 tokens: a boundary (288 MiB), an attention output (144 MiB), k or v
        // (36 MiB) and an lse (2.25 MiB) are pinned at their own size.
        for bytes in [288 * mib, 144 * mib, 36 * mib, 9 * mib / 4] {
            assert_eq!(pinned_capacity(bytes), bytes);
        }
        for bytes in [mib + 1, 150_994_944 + 12_345, 5_000_000_000] {
            let cap = pinned_capacity(bytes);
            assert!(
                cap >= bytes && (cap - bytes) * 8 <= bytes,
                "{bytes} -> {cap}"
            );
        }
    }
}
