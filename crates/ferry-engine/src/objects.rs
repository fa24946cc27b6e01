//! Objects that several processes (or several mappings and descriptors) may share: shared
//! memory and deleted-but-still-used files. Each is captured once and recreated once.

use crate::error::{Context, Error, Result};
use crate::procfs::MapEntry;
use ferry_image::stream::ObjectRef;
use ferry_image::{GhostFile, ImageWriter, ShmemKind, ShmemObject, Vma};
use ferry_sys::PAGE_SIZE;
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};

#[derive(Default)]
pub struct CaptureObjects {
    pub shmem: Vec<ShmemObject>,
    pub ghosts: Vec<GhostFile>,
    keys: HashMap<(u64, u64), u32>,
    ghost_keys: HashMap<(u64, u64), u32>,
    sources: HashMap<ObjectRef, File>,
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
    ghosts: HashMap<u32, (File, String)>,
    /// Files that stood where a deleted file has to be recreated: moved aside meanwhile,
    /// (temporary name, real name).
    displaced: Vec<(String, String)>,
    put_back: std::cell::Cell<bool>,
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
    pub fn create(shmem: &[ShmemObject], ghosts: &[GhostFile]) -> Result<Self> {
        let mut me = RestoreObjects::default();
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
        for g in ghosts {
            // The descriptor must show the old path once unlinked, so the file is recreated
            // under that very name; a file that now has the name steps aside meanwhile.
            if std::fs::symlink_metadata(&g.path).is_ok() {
                let aside = format!("{}.ferry-aside-{}", g.path, std::process::id());
                std::fs::rename(&g.path, &aside).ctx(own, || {
                    format!(
                        "move {} aside to recreate the deleted file of that name",
                        g.path
                    )
                })?;
                me.displaced.push((aside, g.path.clone()));
            }
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&g.path)
                .ctx(own, || format!("recreate deleted file {}", g.path))?;
            let _ = std::fs::set_permissions(
                &g.path,
                std::os::unix::fs::PermissionsExt::from_mode(g.mode & 0o7777),
            );
            let _ = std::os::unix::fs::chown(&g.path, Some(g.uid), Some(g.gid));
            file.set_len(g.size)
                .ctx(own, || format!("size deleted file {}", g.path))?;
            me.ghosts.insert(g.id, (file, g.path.clone()));
        }
        Ok(me)
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
            ObjectRef::Ghost(id) => self.ghosts.get(&id).map(|(f, _)| f),
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

    pub fn ghost_path(&self, id: u32) -> Result<&str> {
        self.ghosts
            .get(&id)
            .map(|(_, p)| p.as_str())
            .ok_or_else(|| Error::BadImage(format!("unknown deleted file {id}")))
    }

    /// The file a file-backed mapping maps: the file at `path`, or a recreated deleted file.
    pub fn mapping_file(&self, pid: i32, path: &str, ghost: Option<u32>, v: &Vma) -> Result<File> {
        let path = match ghost {
            Some(id) => self.ghost_path(id)?.to_string(),
            None => path.to_string(),
        };
        let write = v.shared && v.prot & libc::PROT_WRITE as u32 != 0;
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(&path)
            .map_err(|e| Error::Restore {
                pid,
                what: format!("open {path} to map it at {:x}: {e}", v.start),
            })
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
        for (_, path) in self.ghosts.values() {
            let _ = std::fs::remove_file(path);
        }
        for (aside, path) in &self.displaced {
            if let Err(e) = std::fs::rename(aside, path) {
                log::error!("could not move {aside} back to {path}: {e}");
            }
        }
    }
}

impl Drop for RestoreObjects {
    fn drop(&mut self) {
        self.put_back();
    }
}
