//! Objects that several processes (or several mappings and descriptors) may share: shared
//! memory and deleted-but-still-used files. Each is captured once and recreated once.

use crate::error::{Context, Error, Result};
use crate::procfs::MapEntry;
use crate::reopen::{Match, Rights};
use ferry_image::stream::ObjectRef;
use ferry_image::{
    Backing, FileIdentity, FileKind, GhostFile, ImageWriter, Process, ShmemKind, ShmemObject, Tree,
    Vma,
};
use ferry_sys::fsid::{self, with_fs_creds, FsCreds};
use ferry_sys::PAGE_SIZE;
use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

#[derive(Default)]
pub struct CaptureObjects {
    pub shmem: Vec<ShmemObject>,
    pub ghosts: Vec<GhostFile>,
    keys: HashMap<(u64, u64), u32>,
    ghost_keys: HashMap<(u64, u64), u32>,
    sources: HashMap<ObjectRef, File>,
    /// The kernel AIO rings seen so far (by inode), and the process mapping each.
    pub(crate) aio_rings: HashMap<u64, i32>,
}

impl CaptureObjects {
    pub fn is_shmem(&self, m: &MapEntry) -> bool {
        m.name.starts_with("/memfd:")
            || m.name.starts_with("/SYSV")
            || (m.shared() && m.name == "/dev/zero (deleted)")
    }

    pub fn shmem_for_mapping(&mut self, pid: i32, m: &MapEntry) -> Result<u32> {
        if let Some(id) = self.keys.get(&(m.dev, m.ino)) {
            return Ok(*id);
        }
        let file = File::open(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end))
            .ctx(pid, || {
                format!("open the shared memory behind {:x}-{:x}", m.start, m.end)
            })?;
        if m.name.starts_with("/SYSV") {
            return self.add_sysv(pid, file, m);
        }
        self.add_shmem(pid, file, &m.name, m.dev, m.ino)
    }

    /// A System V segment. The kernel numbers a segment's file with its shmid, so the mapping's
    /// inode finds its row in /proc/sysvipc/shm.
    fn add_sysv(&mut self, pid: i32, file: File, m: &MapEntry) -> Result<u32> {
        let table = {
            let _visit = ferry_sys::ns::IpcNamespaceVisit::enter(pid)
                .ctx(pid, || "enter its IPC namespace".into())?;
            std::fs::read_to_string("/proc/sysvipc/shm")
                .ctx(pid, || "read /proc/sysvipc/shm".into())?
        };
        // key shmid perms size cpid lpid nattch uid gid cuid cgid atime dtime ctime rss swap
        let row = table.lines().skip(1).find_map(|line| {
            let c: Vec<&str> = line.split_whitespace().collect();
            let shmid: u64 = c.get(1)?.parse().ok()?;
            (shmid == m.ino).then_some(())?;
            Some((
                c[0].parse::<i32>().ok()?,
                shmid as i32,
                u32::from_str_radix(c.get(2)?, 8).ok()?,
                c.get(3)?.parse::<u64>().ok()?,
            ))
        });
        let (key, shmid, mode, size) = row.ok_or_else(|| Error::Unsupported {
            pid,
            what: format!("mapping {:x}-{:x} ({})", m.start, m.end, m.name),
            why: format!("System V segment {} is not in /proc/sysvipc/shm", m.ino),
        })?;
        let id = self.shmem.len() as u32;
        self.shmem.push(ShmemObject {
            id,
            kind: ShmemKind::SysV { key, shmid, mode },
            size,
            ino: m.ino,
        });
        self.keys.insert((m.dev, m.ino), id);
        self.sources.insert(ObjectRef::Shmem(id), file);
        Ok(id)
    }

    /// Registers a memfd that a process has open (whether or not it is mapped).
    pub fn shmem_for_fd(
        &mut self,
        pid: i32,
        fd: i32,
        link: &str,
        dev: u64,
        ino: u64,
    ) -> Result<u32> {
        if let Some(id) = self.keys.get(&(dev, ino)) {
            return Ok(*id);
        }
        let file = File::open(format!("/proc/{pid}/fd/{fd}"))
            .ctx(pid, || format!("reopen fd {fd} ({link})"))?;
        self.add_shmem(pid, file, link, dev, ino)
    }

    fn add_shmem(&mut self, pid: i32, file: File, name: &str, dev: u64, ino: u64) -> Result<u32> {
        let id = self.shmem.len() as u32;
        let size = file.metadata().ctx(pid, || format!("stat {name}"))?.len();
        let kind = match name.strip_prefix("/memfd:") {
            Some(rest) => ShmemKind::Memfd {
                name: rest.strip_suffix(" (deleted)").unwrap_or(rest).to_string(),
                seals: ferry_sys::fdops::get_seals(file.as_raw_fd()).unwrap_or(0),
            },
            None => ShmemKind::Anonymous,
        };
        self.shmem.push(ShmemObject {
            id,
            kind,
            size,
            ino,
        });
        self.keys.insert((dev, ino), id);
        self.sources.insert(ObjectRef::Shmem(id), file);
        Ok(id)
    }

    pub fn ghost_for_mapping(&mut self, pid: i32, m: &MapEntry) -> Result<u32> {
        let src = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
        self.ghost(pid, &src, m.path(), m.dev, m.ino)
    }

    pub fn ghost_for_fd(
        &mut self,
        pid: i32,
        fd: i32,
        path: &str,
        dev: u64,
        ino: u64,
    ) -> Result<u32> {
        self.ghost(pid, &format!("/proc/{pid}/fd/{fd}"), path, dev, ino)
    }

    fn ghost(&mut self, pid: i32, src: &str, path: &str, dev: u64, ino: u64) -> Result<u32> {
        if let Some(id) = self.ghost_keys.get(&(dev, ino)) {
            return Ok(*id);
        }
        let file = File::open(src).ctx(pid, || format!("open deleted file {path}"))?;
        let md = file
            .metadata()
            .ctx(pid, || format!("stat deleted file {path}"))?;
        let id = self.ghosts.len() as u32;
        self.ghosts.push(GhostFile {
            id,
            path: path.to_string(),
            mode: md.mode(),
            uid: md.uid(),
            gid: md.gid(),
            size: md.len(),
        });
        self.ghost_keys.insert((dev, ino), id);
        self.sources.insert(ObjectRef::Ghost(id), file);
        Ok(id)
    }

    /// Writes the contents of every object: only the ranges that hold data, zero pages left out.
    pub fn write_contents<W: Write>(&self, out: &mut ImageWriter<W>) -> std::io::Result<u64> {
        let mut written = 0;
        let mut refs: Vec<&ObjectRef> = self.sources.keys().collect();
        refs.sort_by_key(|r| format!("{r:?}"));
        for r in refs {
            let file = &self.sources[r];
            let size = file.metadata()?.len();
            let mut pos = 0u64;
            while pos < size {
                // Shared memory lives on tmpfs, whose SEEK_DATA/SEEK_HOLE skip what was never
                // written. Deleted files may live anywhere (ext4 answers ENXIO for small files
                // kept inline in the inode), so they are read whole, zero pages dropped below.
                let (data_start, hole) = match r {
                    ObjectRef::Ghost(_) => (pos, size),
                    ObjectRef::Shmem(_) => {
                        let Ok(start) =
                            ferry_sys::fdops::lseek(file.as_raw_fd(), pos as i64, libc::SEEK_DATA)
                        else {
                            break;
                        };
                        let hole =
                            ferry_sys::fdops::lseek(file.as_raw_fd(), start, libc::SEEK_HOLE)
                                .unwrap_or(size as i64);
                        (start as u64, (hole as u64).clamp(start as u64 + 1, size))
                    }
                };
                let mut off = data_start;
                while off < hole {
                    let len = (hole - off).min(ferry_image::stream::CHUNK as u64) as usize;
                    let mut buf = vec![0u8; len];
                    let n = file.read_at(&mut buf, off)?;
                    buf.truncate(n);
                    if n == 0 {
                        break;
                    }
                    let page = PAGE_SIZE as usize;
                    let mut k = 0;
                    while k < n {
                        let end = (k + page).min(n);
                        if crate::resources::memory::is_zero(&buf[k..end]) {
                            k = end;
                            continue;
                        }
                        let mut e = end;
                        while e < n
                            && !crate::resources::memory::is_zero(&buf[e..(e + page).min(n)])
                        {
                            e = (e + page).min(n);
                        }
                        out.write_object(*r, off + k as u64, &buf[k..e])?;
                        written += (e - k) as u64;
                        k = e;
                    }
                    off += n as u64;
                }
                pos = hole;
            }
        }
        Ok(written)
    }
}

/// The recreated objects, held open by the restoring process until every process is built.
#[derive(Default)]
pub struct RestoreObjects {
    shmem: HashMap<u32, File>,
    memfd_seals: Vec<(u32, u32)>,
    ghosts: HashMap<u32, Ghost>,
    put_back: std::cell::Cell<bool>,
    /// Whoever asked for the restore (`None`: Ferry itself, root).
    caller: Option<FsCreds>,
    /// System V segments: recreated from inside the first process that attaches them (so that
    /// their creator PID is right); their contents wait here until then.
    sysv: HashMap<u32, SysvSegment>,
}

struct SysvSegment {
    key: i32,
    shmid: i32,
    mode: u32,
    size: u64,
    data: std::cell::RefCell<Vec<(u64, Vec<u8>)>>,
    /// The host PID of the process that recreated it: in its IPC namespace (a guest's own,
    /// in guest namespaces) the segment lives.
    creator: std::cell::Cell<Option<i32>>,
}

impl RestoreObjects {
    /// Recreates the tree's shared objects and deleted files. `caller`: whoever asked for the
    /// restore (`None`: Ferry itself, root); see [`crate::reopen`].
    pub fn create(tree: &Tree, caller: Option<&FsCreds>) -> Result<Self> {
        let shmem = &tree.shmem;
        let mut me = RestoreObjects::default();
        me.caller = caller.cloned();
        let own = std::process::id() as i32;
        for o in shmem {
            let file = match &o.kind {
                ShmemKind::Anonymous => ferry_sys::fdops::anon_shmem(o.size.max(PAGE_SIZE))
                    .ctx(own, || format!("create shared memory object {}", o.id))?,
                ShmemKind::Memfd { name, seals } => {
                    let fd = ferry_sys::fdops::memfd_create(
                        name,
                        libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
                    )
                    .ctx(own, || format!("recreate memfd {name}"))?;
                    let f = File::from(fd);
                    f.set_len(o.size)
                        .ctx(own, || format!("size memfd {name}"))?;
                    if *seals != 0 {
                        me.memfd_seals.push((o.id, *seals));
                    }
                    f
                }
                ShmemKind::SysV { key, shmid, mode } => {
                    let seg = SysvSegment {
                        key: *key,
                        shmid: *shmid,
                        mode: *mode,
                        size: o.size,
                        data: Default::default(),
                        creator: Default::default(),
                    };
                    me.sysv.insert(o.id, seg);
                    continue;
                }
            };
            me.shmem.insert(o.id, file);
        }
        for g in &tree.ghosts {
            let (holder, how) = ghost_holder(tree, g.id).ok_or_else(|| {
                Error::BadImage(format!(
                    "deleted file {} ({}) is held by no process",
                    g.id, g.path
                ))
            })?;
            let ghost = Ghost::recreate(g, holder.pid, &how, &me.rights(holder).process)?;
            me.ghosts.insert(g.id, ghost);
        }
        Ok(me)
    }

    /// Whoever asked for the restore (`None`: Ferry itself, root).
    pub fn caller(&self) -> Option<&FsCreds> {
        self.caller.as_ref()
    }

    /// Whose rights a file operation for process `p` uses: its own, then (for the very file
    /// captured) the caller's.
    pub fn rights<'a>(&'a self, p: &Process) -> Rights<'a> {
        Rights::of(p, self.caller.as_ref())
    }

    /// A new descriptor of the recreated deleted file `id`, opened with `flags` as `rights`
    /// allow.
    pub fn reopen_ghost(&self, id: u32, flags: i32, rights: &Rights<'_>) -> Result<OwnedFd> {
        let g = self
            .ghosts
            .get(&id)
            .ok_or_else(|| Error::BadImage(format!("unknown deleted file {id}")))?;
        let through = format!("/proc/self/fd/{}", g.file.as_raw_fd());
        let open = |creds: &FsCreds| {
            with_fs_creds(creds, || {
                ferry_sys::fdops::open_path(&through, flags | libc::O_CLOEXEC, 0)
            })
            .and_then(|r| r)
        };
        // Our own descriptor of the file we made: no other can stand in its place, so the
        // caller's rights may open it when the process's are refused (it may have changed its
        // mode since it opened it).
        open(&rights.process)
            .or_else(|e| match e.errno {
                libc::EACCES | libc::EPERM => {
                    open(&rights.caller.cloned().unwrap_or_else(FsCreds::root))
                }
                _ => Err(e),
            })
            .ctx(rights.pid, || {
                format!("reopen recreated deleted file {}", g.path)
            })
    }

    pub fn fill(&self, object: ObjectRef, offset: u64, data: &[u8]) -> Result<()> {
        if let ObjectRef::Shmem(id) = object {
            if let Some(seg) = self.sysv.get(&id) {
                seg.data.borrow_mut().push((offset, data.to_vec()));
                return Ok(());
            }
        }
        let file = match object {
            ObjectRef::Shmem(id) => self.shmem.get(&id),
            ObjectRef::Ghost(id) => self.ghosts.get(&id).map(|g| &g.file),
        }
        .ok_or_else(|| Error::BadImage(format!("data for unknown object {object:?}")))?;
        file.write_all_at(data, offset)
            .ctx(std::process::id() as i32, || format!("fill {object:?}"))
    }

    pub fn shmem_file(&self, id: u32) -> Result<&File> {
        self.shmem
            .get(&id)
            .ok_or_else(|| Error::BadImage(format!("unknown shared memory object {id}")))
    }

    /// The file a file-backed mapping of process `pid` maps: the file at `path` (opened as
    /// `rights` allow, and only if it is still the file captured), or a recreated deleted file.
    pub fn mapping_file(&self, rights: &Rights<'_>, backing: &Backing, v: &Vma) -> Result<File> {
        let Backing::File {
            path,
            dev,
            ino,
            size,
            ghost,
        } = backing
        else {
            return Err(Error::BadImage(format!(
                "PID {}: mapping {:x}-{:x} is not backed by a file",
                rights.pid, v.start, v.end
            )));
        };
        // A shared mapping of a file opened for writing may be made writable later (mprotect),
        // even if it is read-only now: its file is opened for writing again.
        let write = v.shared && (v.prot & libc::PROT_WRITE as u32 != 0 || v.may_write);
        let flags = if write { libc::O_RDWR } else { libc::O_RDONLY };
        let fd = match ghost {
            Some(id) => self.reopen_ghost(*id, flags, rights)?,
            None => {
                let want = FileIdentity {
                    dev: *dev,
                    ino: *ino,
                    mode: libc::S_IFREG,
                    size: *size,
                    ..Default::default()
                };
                crate::reopen::open(
                    rights.pid,
                    &format!("mapping {:x}-{:x}", v.start, v.end),
                    path,
                    flags,
                    Some(&want),
                    Match::Mapped,
                    rights,
                )?
            }
        };
        Ok(File::from(fd))
    }

    /// Seals memfds and unlinks recreated deleted files, once every process holds them.
    pub fn is_sysv(&self, id: u32) -> bool {
        self.sysv.contains_key(&id)
    }

    /// Attaches System V object `id` at the mapping `v` of the husk, creating the segment (under
    /// its old shmid) and filling it at the first attach.
    pub fn attach_sysv(&self, h: &crate::husk::Husk, id: u32, v: &Vma) -> Result<()> {
        let seg = self
            .sysv
            .get(&id)
            .ok_or_else(|| Error::BadImage(format!("unknown System V object {id}")))?;
        let inj = h.injector();
        let pid = h.pid;
        // Looked up, removed and numbered in the IPC namespace of the process (a guest's own).
        let _visit = ferry_sys::ns::IpcNamespaceVisit::enter(h.host)
            .ctx(pid, || "enter its IPC namespace".into())?;
        if seg.creator.get().is_none() {
            // A segment left over by the checkpointed (and killed) tree holds the old shmid.
            if let Ok((_, nattch)) = ferry_sys::fdops::shm_stat(seg.shmid) {
                if nattch != 0 {
                    return Err(Error::Restore {
                        pid,
                        what: format!(
                            "System V segment {} is in use by other processes",
                            seg.shmid
                        ),
                    });
                }
                ferry_sys::fdops::shm_remove(seg.shmid).ctx(pid, || {
                    format!("remove stale System V segment {}", seg.shmid)
                })?;
            }
            std::fs::write("/proc/sys/kernel/shm_next_id", seg.shmid.to_string())
                .ctx(pid, || "set shm_next_id".into())?;
            let flags = (libc::IPC_CREAT | libc::IPC_EXCL) as u64 | (seg.mode & 0o777) as u64;
            let got = inj.syscall(
                "shmget",
                libc::SYS_shmget,
                &[seg.key as u32 as u64, seg.size, flags],
            );
            let _ = std::fs::write("/proc/sys/kernel/shm_next_id", "-1");
            let got = got?;
            if got as i32 != seg.shmid {
                return Err(Error::Restore {
                    pid,
                    what: format!("System V segment came back as {got}, not {}", seg.shmid),
                });
            }
            seg.creator.set(Some(h.host));
        }
        let mut flags = 0u64;
        if v.prot & libc::PROT_WRITE as u32 == 0 {
            flags |= libc::SHM_RDONLY as u64;
        }
        if v.prot & libc::PROT_EXEC as u32 != 0 {
            flags |= 0o100000; // SHM_EXEC
        }
        let at = inj.syscall(
            "shmat",
            libc::SYS_shmat,
            &[seg.shmid as u64, v.start, flags],
        )?;
        if at != v.start {
            return Err(Error::Restore {
                pid,
                what: format!(
                    "System V segment {} attached at {at:x}, not {:x}",
                    seg.shmid, v.start
                ),
            });
        }
        let pending = std::mem::take(&mut *seg.data.borrow_mut());
        if !pending.is_empty() {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(format!(
                    "/proc/{}/map_files/{:x}-{:x}",
                    h.host, v.start, v.end
                ))
                .ctx(pid, || format!("open System V segment {}", seg.shmid))?;
            for (off, data) in pending {
                f.write_all_at(&data, off)
                    .ctx(pid, || format!("fill System V segment {}", seg.shmid))?;
            }
        }
        Ok(())
    }

    pub fn finish(&self) {
        for seg in self.sysv.values() {
            // Marked for removal at checkpoint: removed now that every process is attached.
            if seg.mode & 0o1000 != 0 {
                let visit = seg
                    .creator
                    .get()
                    .map(ferry_sys::ns::IpcNamespaceVisit::enter);
                if let Some(Err(e)) = visit {
                    log::warn!(
                        "System V segment {}: enter its IPC namespace: {e}",
                        seg.shmid
                    );
                    continue;
                }
                let _ = ferry_sys::fdops::shm_remove(seg.shmid);
            }
        }
        for (id, seals) in &self.memfd_seals {
            if let Some(f) = self.shmem.get(id) {
                if let Err(e) = ferry_sys::fdops::add_seals(f.as_raw_fd(), *seals) {
                    log::warn!("sealing memfd object {id}: {e}");
                }
            }
        }
        self.put_back();
    }

    /// A restore failed: removes the System V segments it made, while the processes that
    /// attached them (and whose IPC namespace they live in) still exist. Memfds and shared
    /// memory objects go with their descriptors, recreated deleted files when dropped.
    pub fn abandon(&self) {
        for seg in self.sysv.values() {
            let Some(creator) = seg.creator.get() else {
                continue;
            };
            match ferry_sys::ns::IpcNamespaceVisit::enter(creator) {
                Ok(_visit) => {
                    if let Err(e) = ferry_sys::fdops::shm_remove(seg.shmid) {
                        log::warn!("remove System V segment {}: {e}", seg.shmid);
                    }
                }
                Err(e) => log::warn!(
                    "System V segment {}: enter its IPC namespace: {e}",
                    seg.shmid
                ),
            }
        }
    }

    fn put_back(&self) {
        if self.put_back.replace(true) {
            return;
        }
        for g in self.ghosts.values() {
            g.remove();
        }
    }
}

/// The first process of the tree that holds deleted file `id`, and how (its descriptor or
/// mapping, for messages).
fn ghost_holder(tree: &Tree, id: u32) -> Option<(&Process, String)> {
    let held = tree.processes.iter().find_map(|p| {
        let by_fd = p.fds.iter().find(|f| {
            matches!(
                tree.files.get(f.file as usize).map(|d| &d.kind),
                Some(FileKind::Regular { ghost: Some(g), .. }) if *g == id
            )
        });
        if let Some(f) = by_fd {
            return Some((p, format!("fd {}", f.fd)));
        }
        p.vmas
            .iter()
            .find(|v| matches!(&v.backing, Backing::File { ghost: Some(g), .. } if *g == id))
            .map(|v| (p, format!("mapping {:x}-{:x}", v.start, v.end)))
    });
    if held.is_some() {
        return held;
    }
    // Only in flight (SCM_RIGHTS): for the process holding the socket that carries it.
    let file = tree
        .files
        .iter()
        .find(|d| matches!(&d.kind, FileKind::Regular { ghost: Some(g), .. } if *g == id))?;
    let mut holders: HashMap<u32, (&Process, i32)> = HashMap::new();
    for p in tree.processes.iter().filter(|p| p.zombie_status.is_none()) {
        for f in &p.fds {
            holders.entry(f.file).or_insert((p, f.fd));
        }
    }
    crate::resources::sockets::holders_in_flight(tree, &mut holders, None);
    holders
        .get(&file.id)
        .map(|(p, _)| (*p, format!("file {} in flight", file.id)))
}

/// A deleted file recreated under its old name, so that the descriptors and mappings made from
/// it show that name once it is unlinked again: made in its old directory, with the rights of
/// a process that held it, never through a symbolic link.
struct Ghost {
    file: File,
    path: String,
    /// Its directory (O_PATH), opened without following any link.
    dir: OwnedFd,
    name: OsString,
    /// What had the name before, moved aside meanwhile under this name.
    aside: Option<OsString>,
    creds: FsCreds,
}

impl Ghost {
    fn recreate(g: &GhostFile, pid: i32, how: &str, creds: &FsCreds) -> Result<Ghost> {
        let path = Path::new(&g.path);
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(Error::BadImage(format!(
                "deleted file {} has no name in a directory: {}",
                g.id, g.path
            )));
        };
        if !path.is_absolute() {
            return Err(Error::BadImage(format!(
                "deleted file {} has a relative path: {}",
                g.id, g.path
            )));
        }
        let name = name.to_owned();
        let aside_name = {
            let mut a = name.clone();
            a.push(format!(".ferry-aside-{}", std::process::id()));
            a
        };
        let made = with_fs_creds(creds, || -> std::result::Result<Ghost, String> {
            let dir = fsid::openat2(
                libc::AT_FDCWD,
                &parent.to_string_lossy(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
                0,
                libc::RESOLVE_NO_SYMLINKS,
            )
            .map_err(|e| match e.errno {
                libc::ELOOP => format!(
                    "its directory {}: a symbolic link is in that path now (it was not \
                     when captured)",
                    parent.display()
                ),
                _ => format!("open its directory {}: {e}", parent.display()),
            })?;
            let d = dir.as_raw_fd();
            let aside = match fsid::rename_in(d, &name, &aside_name, true) {
                Ok(()) => Some(aside_name.clone()),
                Err(e) if e.errno == libc::ENOENT => None,
                Err(e) => return Err(format!("move the file that now has its name aside: {e}")),
            };
            let undo = |what: String| {
                if let Some(a) = &aside {
                    let _ = fsid::rename_in(d, a, &name, false);
                }
                what
            };
            let fd = fsid::openat2(
                d,
                &name.to_string_lossy(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                g.mode & 0o7777,
                libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS,
            )
            .map_err(|e| undo(format!("create it: {e}")))?;
            let file = File::from(fd);
            let _ = file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(
                g.mode & 0o7777,
            ));
            // Its owner, when those rights allow it (they do for the file's own owner).
            let _ = std::os::unix::fs::fchown(&file, Some(g.uid), Some(g.gid));
            let ghost = Ghost {
                file,
                path: g.path.clone(),
                dir,
                name: name.clone(),
                aside,
                creds: creds.clone(),
            };
            if let Err(e) = ghost.file.set_len(g.size) {
                ghost.remove();
                return Err(format!("size it to {}: {e}", g.size));
            }
            Ok(ghost)
        });
        let fail = |why: String| Error::Restore {
            pid,
            what: format!(
                "{how}: recreate deleted file {} (as {creds}): {why}",
                g.path
            ),
        };
        made.map_err(|e| fail(e.to_string()))?.map_err(fail)
    }

    /// Unlinks it again, and puts back what had its name.
    fn remove(&self) {
        let d = self.dir.as_raw_fd();
        let r = with_fs_creds(&self.creds, || {
            let mut errors = Vec::new();
            if let Err(e) = fsid::unlink_in(d, &self.name) {
                errors.push(format!("unlink {}: {e}", self.path));
            }
            if let Some(a) = &self.aside {
                if let Err(e) = fsid::rename_in(d, a, &self.name, false) {
                    errors.push(format!("move {a:?} back to {}: {e}", self.path));
                }
            }
            errors
        });
        match r {
            Ok(errors) => {
                for e in errors {
                    log::error!("{e}");
                }
            }
            Err(e) => log::error!("recreated deleted file {}: {e}", self.path),
        }
    }
}

impl Drop for RestoreObjects {
    fn drop(&mut self) {
        self.put_back();
    }
}
