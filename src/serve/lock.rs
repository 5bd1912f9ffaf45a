//! One server per database: an exclusive lock on `<db>.lock`, beside the database, held for the
//! server's life. A second server on the same database would take the first's running job for
//! an interrupted one and run it again into the same folder; with the lock it refuses to start,
//! naming the server that holds it (the file holds that server's pid and address). The lock
//! goes with the process, a crash or `kill -9` included. The file stays on disk when the server
//! stops: removing it could let a server that opened the old file and one that created a new
//! one each hold "the" lock. A link to the database is the same database: a symbolic link's
//! lock file is its target's, and the database file itself is locked too (by its inode, which a
//! hard link shares).

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
    /// The database file's own lock (none while the path is not a file, which is refused
    /// later with its own message).
    _db_file: Option<File>,
}

impl DbLock {
    /// Takes the lock of database `db`, or says which server holds it.
    pub fn acquire(db: &Path) -> Result<DbLock> {
        let real = db.canonicalize().unwrap_or_else(|_| db.to_path_buf());
        let path = lock_path(&real);
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
        // The database itself (created empty where new, which SQLite takes for a new
        // database): a server on a hard link to it has another lock file but this inode.
        let db_file = if db.is_dir() {
            None
        } else {
            let f = File::options()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(db)
                .with_context(|| format!("opening the job database {}", db.display()))?;
            match f.try_lock() {
                Ok(()) => Some(f),
                Err(TryLockError::WouldBlock) => bail!(
                    "the job database {} is in use by another lorafit serve (through another path \
                     to the same file); stop that server first, or give this one its own --db",
                    db.display()
                ),
                Err(TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("locking {}", db.display()))
                }
            }
        };
        let mut lock = DbLock {
            file,
            _db_file: db_file,
        };
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
        // A symbolic or hard link to it is the same database.
        std::os::unix::fs::symlink(&db, dir.join("alias.sqlite")).unwrap();
        let e = format!(
            "{:#}",
            DbLock::acquire(&dir.join("alias.sqlite")).err().unwrap()
        );
        assert!(e.contains("in use by another lorafit serve"), "{e}");
        std::fs::hard_link(&db, dir.join("hard.sqlite")).unwrap();
        let e = format!(
            "{:#}",
            DbLock::acquire(&dir.join("hard.sqlite")).err().unwrap()
        );
        assert!(e.contains("through another path to the same file"), "{e}");
        // Another database is another lock.
        DbLock::acquire(&dir.join("other.sqlite")).unwrap();
        drop(first);
        DbLock::acquire(&db).unwrap();
    }
}
