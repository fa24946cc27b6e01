//! What a file held, for restores on another machine.
//!
//! A restore opens again by path the regular files a tree held or mapped, and only if the path
//! still names the file captured (`crate::reopen`): the same device and inode. On another
//! machine the same file (a library of the same system, a file on a network file system) has
//! another device and inode. So the capture records the SHA-256 of every such file
//! ([`capture`], into `Tree::digests`), read through the process's own descriptor or mapping
//! (`/proc/PID/fd/N`, `/proc/PID/map_files/START-END`: the very file, no path walked) with the
//! process's file-system rights: a file it could not read gets no digest. At restore, a file
//! whose device or inode differ is the one captured if it is a regular file of the same size
//! whose contents hash the same ([`same_contents`]); only under the process's own rights (what
//! it may open itself), never the wider rights `reopen` falls back to for the very file
//! captured.
//!
//! A file's digest is kept on this machine ([`CACHE_DIR`]) under its device, inode, size and
//! change time, so that the libraries and programs of the next tree cost a stat each. Before a
//! tree is frozen, [`warm`] hashes what the cache does not know yet, while the tree runs, so
//! that the freeze only looks digests up. Files larger than [`MAX_DIGESTED`] are hashed only
//! there (up to [`MAX_WARMED`]): in the freeze they would lengthen it. A file with no digest
//! must be the same inode, as before.

use ferry_image::{Backing, FileDigest, FileIdentity, FileKind, Tree};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

/// The largest file the capture hashes itself, in the freeze (when [`warm`] did not).
pub const MAX_DIGESTED: u64 = 64 << 20;

/// The largest file whose contents are recorded: hashed by [`warm`], before the freeze (a
/// JVM's class archive, a database's data file).
pub const MAX_WARMED: u64 = 256 << 20;

/// Digests known on this machine (root's, on a tmpfs: gone at the next boot, when device and
/// inode numbers may name other files), one file each, named by what identifies the file's
/// contents: device, inode, size and change time (which only the kernel sets, and which moves
/// with every write). Libraries and programs are hashed once, not at every freeze.
const CACHE_DIR: &str = "/run/ferry/digests";

fn cache_key(md: &std::fs::Metadata) -> String {
    format!(
        "{:x}-{:x}-{}-{}.{:09}",
        md.dev(),
        md.ino(),
        md.len(),
        md.ctime(),
        md.ctime_nsec()
    )
}

fn cache_get(key: &str) -> Option<[u8; 32]> {
    std::fs::read(format!("{CACHE_DIR}/{key}"))
        .ok()?
        .try_into()
        .ok()
}

/// Best effort: a digest not kept is computed again next time.
fn cache_put(key: &str, sha256: &[u8; 32]) {
    use std::os::unix::fs::DirBuilderExt;
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(CACHE_DIR);
    let tmp = format!("{CACHE_DIR}/.{key}.{}", std::process::id());
    if std::fs::write(&tmp, sha256).is_ok() {
        let _ = std::fs::rename(&tmp, format!("{CACHE_DIR}/{key}"));
    }
}

/// The digests of the tree being restored, by (device, inode) captured.
static RESTORING: Mutex<Option<HashMap<(u64, u64), FileDigest>>> = Mutex::new(None);

/// The SHA-256 of the file at `path` (a magic link, or a path under `/proc/self/fd`), if it is
/// still a regular file of `size` bytes on (`dev`, `ino`) when `dev` is given.
fn hash(path: &str, want: Option<(u64, u64)>, size: u64) -> std::io::Result<Option<[u8; 32]>> {
    use std::os::unix::fs::OpenOptionsExt;
    // Never opened unless a regular file (a mapped device would be opened, with its effects),
    // and then without blocking or taking a terminal.
    let md = std::fs::metadata(path)?;
    if !md.file_type().is_file() {
        return Ok(None);
    }
    // Nor when a write lease is held on it: the open would break the lease (even with
    // O_NONBLOCK, which only spares us the wait).
    if crate::resources::locks::leases_held()
        .iter()
        .any(|&(dev, ino, write)| write && (dev, ino) == (md.dev(), md.ino()))
    {
        return Ok(None);
    }
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let md = f.metadata()?;
    if !md.file_type().is_file()
        || md.len() != size
        || want.is_some_and(|w| w != (md.dev(), md.ino()))
    {
        return Ok(None);
    }
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        h.update(&buf[..n]);
    }
    Ok((total == size).then(|| h.finalize().into()))
}

/// A file to hash: where to read it (a magic link), the device and inode it must still be when
/// they are known, its size, and the key it is cached under.
struct Unhashed {
    path: String,
    want: Option<(u64, u64)>,
    size: u64,
    key: Option<String>,
}

/// Hashes `files` on one thread with `creds` (process `pid`'s rights), keeps each digest in the
/// cache under its key, and returns them in order (`None`: not hashed, said in the log).
fn hash_as(
    pid: i32,
    creds: &ferry_sys::fsid::FsCreds,
    files: &[Unhashed],
) -> Vec<Option<[u8; 32]>> {
    let hashed = ferry_sys::fsid::with_fs_creds(creds, || {
        files
            .iter()
            .map(|f| hash(&f.path, f.want, f.size))
            .collect::<Vec<_>>()
    });
    let hashed = match hashed {
        Ok(h) => h,
        Err(e) => {
            log::debug!("PID {pid}: no digests (rights of {creds}: {e})");
            return vec![None; files.len()];
        }
    };
    files
        .iter()
        .zip(hashed)
        .map(|(f, got)| match got {
            Ok(Some(sha256)) => {
                if let Some(k) = &f.key {
                    cache_put(k, &sha256);
                }
                Some(sha256)
            }
            Ok(None) => None,
            Err(e) => {
                log::debug!("PID {pid}: no digest of {}: {e}", f.path);
                None
            }
        })
        .collect()
}

/// The digests of the regular files `tree`'s processes hold or map by path (each process read
/// as `hosts[i]`, its PID here, with its own file-system rights). Called while the tree is
/// frozen, before its PIDs are translated.
pub fn capture(tree: &Tree, hosts: &[i32]) -> Vec<FileDigest> {
    let t0 = std::time::Instant::now();
    let mut out: Vec<FileDigest> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (p, host) in tree.processes.iter().zip(hosts) {
        if p.zombie_status.is_some() {
            continue;
        }
        // (device, inode, size, where to read it).
        let mut wanted: Vec<(u64, u64, u64, String)> = Vec::new();
        for v in &p.vmas {
            if let Backing::File {
                dev,
                ino,
                size,
                ghost: None,
                ..
            } = &v.backing
            {
                wanted.push((
                    *dev,
                    *ino,
                    *size,
                    format!("/proc/{host}/map_files/{:x}-{:x}", v.start, v.end),
                ));
            }
        }
        for fd in &p.fds {
            let Some(d) = tree.files.get(fd.file as usize) else {
                continue;
            };
            if let (FileKind::Regular { ghost: None, .. }, Some(id)) = (&d.kind, &d.identity) {
                if id.mode & libc::S_IFMT == libc::S_IFREG {
                    wanted.push((
                        id.dev,
                        id.ino,
                        id.size,
                        format!("/proc/{host}/fd/{}", fd.fd),
                    ));
                }
            }
        }
        wanted.retain(|(dev, ino, size, _)| *size <= MAX_WARMED && seen.insert((*dev, *ino)));
        // Known already: taken from the cache (a stat of the very file, and a lookup).
        let mut misses = Vec::new();
        for (dev, ino, size, path) in wanted {
            let key = std::fs::metadata(&path).ok().and_then(|md| {
                ((md.dev(), md.ino(), md.len()) == (dev, ino, size)).then(|| cache_key(&md))
            });
            match key.as_deref().and_then(cache_get) {
                Some(sha256) => out.push(FileDigest {
                    dev,
                    ino,
                    size,
                    sha256,
                }),
                // Larger files only if hashed before the freeze.
                None if size <= MAX_DIGESTED => misses.push(Unhashed {
                    path,
                    want: Some((dev, ino)),
                    size,
                    key,
                }),
                None => log::debug!(
                    "PID {host}: {path} ({size} bytes) was not hashed before the freeze"
                ),
            }
        }
        if misses.is_empty() {
            continue;
        }
        // The rest read by one thread with the process's rights.
        let hashed = hash_as(*host, &crate::reopen::creds_of(p), &misses);
        for (f, got) in misses.iter().zip(hashed) {
            if let (Some(sha256), Some((dev, ino))) = (got, f.want) {
                out.push(FileDigest {
                    dev,
                    ino,
                    size: f.size,
                    sha256,
                })
            }
        }
    }
    log::debug!(
        "digests of {} files ({} bytes) in {:.1} ms",
        out.len(),
        out.iter().map(|d| d.size).sum::<u64>(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    out
}

/// Hashes, while the tree rooted at `root` still runs, the regular files its processes hold or
/// map that the cache does not know yet (up to [`MAX_WARMED`] bytes each), each read through
/// the process's own descriptor or mapping with its file-system rights, as [`capture`] reads
/// them; the capture in the freeze then finds them in the cache. Best effort: what fails here
/// is left to the capture.
pub fn warm(root: i32) {
    let t0 = std::time::Instant::now();
    let Ok(pids) = crate::preflight::tree(root) else {
        return;
    };
    let mut seen = std::collections::HashSet::new();
    let (mut files, mut bytes) = (0usize, 0u64);
    for pid in pids {
        let Ok(creds) = crate::procfs::fs_creds(pid) else {
            continue;
        };
        let mut misses: Vec<Unhashed> = Vec::new();
        for dir in ["map_files", "fd"] {
            let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/{dir}")) else {
                continue;
            };
            for e in entries.flatten() {
                let path = format!("/proc/{pid}/{dir}/{}", e.file_name().to_string_lossy());
                // A deleted file's contents travel in the image.
                let deleted = std::fs::read_link(&path)
                    .map_or(true, |l| l.to_string_lossy().ends_with(" (deleted)"));
                let Ok(md) = std::fs::metadata(&path) else {
                    continue;
                };
                if deleted
                    || !md.file_type().is_file()
                    || md.len() > MAX_WARMED
                    || !seen.insert((md.dev(), md.ino()))
                {
                    continue;
                }
                // Cached under what the file was before it was read: a write since changed
                // its change time, and the entry will not be found.
                let key = cache_key(&md);
                if cache_get(&key).is_none() {
                    misses.push(Unhashed {
                        path,
                        want: None,
                        size: md.len(),
                        key: Some(key),
                    });
                }
            }
        }
        if misses.is_empty() {
            continue;
        }
        for (f, got) in misses.iter().zip(hash_as(pid, &creds, &misses)) {
            if got.is_some() {
                files += 1;
                bytes += f.size;
            }
        }
    }
    log::debug!(
        "digests of {files} files ({bytes} bytes) computed before the freeze in {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
}

/// Makes `tree`'s digests the ones [`same_contents`] compares with, for this restore.
pub fn install(tree: &Tree) {
    let table = tree
        .digests
        .iter()
        .map(|d| ((d.dev, d.ino), d.clone()))
        .collect();
    *RESTORING.lock().unwrap_or_else(|e| e.into_inner()) = Some(table);
}

/// Whether the file open at `through` (found where the file `want` was captured, as `now`)
/// holds what the captured one held: `None` if that cannot be told (no digest recorded, not a
/// regular file, another size), else whether the contents hash the same.
pub fn same_contents(want: &FileIdentity, now: &FileIdentity, through: &str) -> Option<bool> {
    let regular = |m: u32| m & libc::S_IFMT == libc::S_IFREG;
    if !regular(want.mode) || !regular(now.mode) || want.size != now.size {
        return None;
    }
    let d = RESTORING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()?
        .get(&(want.dev, want.ino))
        .cloned()?;
    if d.size != now.size {
        return Some(false);
    }
    match hash(through, None, now.size) {
        Ok(Some(h)) => Some(h == d.sha256),
        Ok(None) => Some(false),
        Err(e) => {
            log::debug!("hash {through}: {e}");
            None
        }
    }
}
