//! One server per database: an exclusive lock on `<db>.lock`, beside the database, held for the
//! server's life. A second server on the same database would take the first's running job for
//! an interrupted one and run it again into the same folder; with the lock it refuses to start,
//! naming the server that holds it (the file holds that server's pid and address). The lock
//! goes with the process, a crash or `kill -9` included. The file stays on disk when the server
//! stops: removing it could let a server that opened the old file and one that created a new
//! one each hold "the" lock.

use anyhow::{bail, Context, Result};
use std::fs::{File, TryLockError};
use std::io::{Seek, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The lock file of database `db`: its name with `.lock` added.
pub fn lock_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_os_string();
    name.push(".lock");
    PathBuf::from(name)
}

/// The held lock; dropping it (or the process ending) releases it.
pub struct DbLock {
    file: File,
}

impl DbLock {
    /// Takes the lock of database `db`, or says which server holds it.
    pub fn acquire(db: &Path) -> Result<DbLock> {
        let path = lock_path(db);
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening the lock file {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = match holder.trim() {
                    "" => String::new(),
                    h => format!(" ({h})"),
                };
                bail!(
                    "the job database {} is in use by another lorafit serve{holder}; stop that \
                     server first, or give this one its own --db",
                    db.display()
                );
            }
            Err(TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()))
            }
        }
        let mut lock = DbLock { file };
        lock.record(&format!("pid {}", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(lock)
    }

    /// Records the address the server listens on, for a refused second server to name.
    pub fn record_address(&mut self, addr: SocketAddr) -> Result<()> {
        self.record(&format!("pid {}, http://{addr}", std::process::id()))
    }

    fn record(&mut self, holder: &str) -> Result<()> {
        self.file.set_len(0)?;
        self.file.rewind()?;
        self.file.write_all(holder.as_bytes())?;
        self.file.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_one_database_is_refused_naming_the_holder() {
        let dir = std::env::temp_dir().join(format!("lorafit-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("jobs.sqlite");
        assert_eq!(lock_path(&db), dir.join("jobs.sqlite.lock"));
        let mut first = DbLock::acquire(&db).unwrap();
        first
            .record_address("127.0.0.1:8420".parse().unwrap())
            .unwrap();
        // A second open of the file is its own lock, as a second process's would be.
        let e = format!("{:#}", DbLock::acquire(&db).err().unwrap());
        assert!(
            e.contains(&db.display().to_string())
                && e.contains(&format!(
                    "pid {}, http://127.0.0.1:8420",
                    std::process::id()
                )),
            "{e}"
        );
        // Another database is another lock.
        DbLock::acquire(&dir.join("other.sqlite")).unwrap();
        drop(first);
        DbLock::acquire(&db).unwrap();
    }
}
