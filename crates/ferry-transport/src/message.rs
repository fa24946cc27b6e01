//! Every message Ferry sends: between daemons (over mutual TLS) and between the CLI and the
//! daemon of its own machine (over a root-only UNIX socket). One enum serves both so a daemon can
//! relay a remote program's I/O to the CLI frame by frame. Variants and fields are only ever
//! added, never renamed; docs/wire-format.md describes the conversations.

use ferry_policy::NodeLoad;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Msg {
    // ---- Between daemons -------------------------------------------------------------
    /// First message of every connection between daemons: who is calling.
    Hello {
        node: String,
    },
    /// A membership (SWIM) packet, opaque to the transport.
    Gossip {
        packet: ByteBuf,
    },
    /// "May I send you this tree?" Answered by `Accept`, `AcceptCompressed` or `Refused`.
    MigrateOffer(MigrateOffer),
    Accept,
    /// `Accept`, and the stream may come in compressed frames of `codec` (one the offer
    /// listed in `compress`: `frame::LZ4`).
    AcceptCompressed {
        codec: String,
    },
    Refused {
        reason: String,
    },
    /// The destination rebuilt the tree and holds it stopped. The source's commit point.
    Rebuilt(Rebuilt),
    /// The source destroyed its copy: the destination may let the tree run.
    Commit,
    /// The tree runs at the destination.
    Resumed,
    /// Either side gives up before the commit point; the tree stays at the source.
    Abort {
        reason: String,
    },
    /// A destination that lost the source after `Rebuilt` asks how migration `id` ended.
    OutcomeQuery {
        id: u64,
    },
    Outcome {
        id: u64,
        committed: bool,
    },

    // ---- Remote execution (caller <-> its daemon <-> remote daemon) ------------------
    Run(RunSpec),
    Started {
        node: String,
        pid: i32,
    },
    /// Bytes of stdin (0), stdout (1) or stderr (2).
    Io {
        stream: u8,
        data: ByteBuf,
    },
    IoEnd {
        stream: u8,
    },
    Signal {
        signal: i32,
    },
    Resize {
        rows: u16,
        cols: u16,
    },
    /// How the remote program ended: an exit code, or the signal that killed it.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// The program could not be started (instead of `Started`); `ferry run` prints `message`
    /// and exits with `exit_code`, a shell's: 127 command not found, 126 not executable, 125
    /// anything else (cwd, credentials).
    RunFailed {
        message: String,
        exit_code: i32,
    },

    // ---- CLI <-> its daemon -----------------------------------------------------------
    ListNodes,
    Nodes(Vec<NodeInfo>),
    ListProcesses,
    Processes(Vec<ProcInfo>),
    /// The processes this daemon hosts or is home for (asked of peers by `ListProcesses`).
    LocalProcesses,
    Migrate {
        pid: i32,
        to: String,
        /// How memory moves: "eager", "precopy", "lazy", "hybrid" or "auto" (empty, from an
        /// older CLI: auto).
        #[serde(default)]
        memory: String,
    },
    /// Whether this node takes guests from now on (the owner wants the machine, or lends it).
    SetAccepting {
        accepting: bool,
    },
    Done,
    Progress {
        phase: String,
        bytes: u64,
    },
    Migrated(MigrateReport),
    Error {
        message: String,
    },
    /// The whole cluster in one answer (`ferry top`, the daemon's page): answered by `View`
    /// with every node and every process under Ferry, each with what it costs its home.
    Cluster,
    /// Asked of peers by `Cluster`: this node's part (its guests, and what the processes that
    /// left it cost it), answered by `View` with no nodes.
    LocalView,
    View(ClusterView),
    /// `ferry checkpoint` of a caller who is not root: the daemon checkpoints for it
    /// (docs/security.md, "Users who are not root") and answers `Output`. `dir` and `parent`
    /// are absolute paths; they are opened with the caller's rights.
    Checkpoint {
        pid: i32,
        dir: String,
        leave_running: bool,
        parent: Option<String>,
        json: bool,
    },
    /// `ferry restore` of a caller who is not root, answered by `Output`.
    Restore {
        dir: String,
        pid_namespace: bool,
        json: bool,
    },
    /// What a command the daemon ran for the caller printed, and its exit code.
    Output {
        code: i32,
        stdout: ByteBuf,
        stderr: ByteBuf,
    },

    // ---- A daemon <-> its engine workers (over pipes) --------------------------------
    /// Capture worker: the tree passed the preflight checks and can be moved.
    Movable {
        memory_bytes: u64,
        uid: u32,
        command: String,
        /// The tree can be rebuilt in place of its deputies when it comes home
        /// (`MigrateOffer::in_place`).
        #[serde(default)]
        in_place: bool,
        /// Its memory moves lazily (asked, or chosen by `auto`).
        #[serde(default)]
        lazy: bool,
        /// A descriptor of a device of this machine the tree holds (the console, a virtual
        /// terminal, /dev/kmsg open for reading ...), named: it moves only to a node on this
        /// machine (`MigrateOffer::machine_bound`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        machine: Option<String>,
    },
    /// Daemon to capture worker: freeze and stream the image.
    Go,
    /// Capture worker, before `Frozen`: how memory moved (pre-copy rounds, with the tree
    /// running, were streamed ahead of the image).
    MemoryPlan(Box<MemoryPlan>),
    Frozen,
    Captured {
        image_bytes: u64,
        /// Pipes shared with processes outside the tree, to relay (a migration from home).
        #[serde(default)]
        relays: Vec<RelayedPipe>,
        /// When the capture's steps ended ([`Stamp`]).
        #[serde(default)]
        timeline: Vec<Stamp>,
    },
    /// Capture worker, before `Captured`: memory the image carried, and memory it left to
    /// the pre-copy rounds.
    CapturedMemory {
        frozen_bytes: u64,
        inherited_bytes: u64,
    },
    /// Daemon to capture worker at the commit point: destroy the original.
    Kill,
    Killed,
    /// Daemon to capture worker before the commit point: let the original carry on.
    Thaw,
    Thawed,
    /// Daemon to restore worker after the commit: let the rebuilt tree run.
    Resume,

    // ---- Lazy memory (`--memory lazy`): the destination's page server <-> the source ----
    /// Restore worker, through both daemons, to the capture worker: send `len` bytes (at most
    /// `frame::DATA_CHUNK`) of the memory of process `pid` (the tree's number) at `addr`.
    /// Answered by `PageReply` with the same `id` and one `Data` frame of exactly `len` bytes
    /// (with `holes`: `len` less the holes' bytes), or by `PageError`. A request unanswered for
    /// a while is asked again under the same `id` (a late second answer is then told apart by
    /// its `id` and dropped).
    PageWant {
        pid: i32,
        addr: u64,
        len: u64,
        #[serde(default)]
        id: u64,
        /// The asker takes holes: the source may name the pages of the range it holds nothing
        /// for (never present, or dropped) instead of sending their zeros.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        holes: bool,
    },
    /// The `Data` frame that follows answers request `id`.
    PageReply {
        id: u64,
        /// Ranges `[start, end)` of the request (page-aligned, sorted, disjoint) the source
        /// holds no page of: they read as zeros, and the `Data` frame carries only the rest,
        /// in address order. Only for a request that said `holes`.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        holes: Vec<(u64, u64)>,
        /// The holes are the whole request: no `Data` frame follows.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        all_holes: bool,
    },
    /// The source cannot supply the memory asked for: why.
    PageError {
        message: String,
        #[serde(default)]
        id: u64,
    },
    /// Daemon to capture worker, at the commit point of a lazy migration: the copy is the one
    /// that runs; keep serving its memory, and from now on the original dies with the worker.
    Committed,
    /// Restore worker, and then the destination to the source: every page is in; the source's
    /// memory is no longer needed.
    LazyDone(Box<LazyReport>),

    // ---- The deputy: a moved tree's home <-> its body's node, a daemon <-> its deputies --
    /// Daemon to capture worker at the commit point of a tree leaving its home, instead of
    /// `Kill`: keep the originals as deputies (ferry_deputy::home), and stay their tracer.
    Deputize,
    /// Capture worker: the originals are deputies now, these PIDs.
    Deputized {
        pids: Vec<i32>,
    },
    /// Deputies' worker to its daemon: signal `sig` was sent to deputy `pid` (held back there).
    DeputySignal {
        pid: i32,
        sig: i32,
        /// Sent with a sender's siginfo the body can be given too (sigqueue).
        #[serde(default)]
        queued: Option<SigQueued>,
    },
    /// Deputies' worker to its daemon: deputy `pid` ended with wait status `status`, as its
    /// body did (`mirrored`) or killed at home.
    DeputyEnded {
        pid: i32,
        status: i32,
        mirrored: bool,
    },
    /// Daemon to its deputies' worker: their tree is coming home; let every deputy go, parked
    /// for the restore worker to rebuild the process in its place.
    ReleaseDeputies,
    /// Deputies' worker: these deputies were let go (and the worker exits).
    DeputiesReleased {
        pids: Vec<i32>,
    },
    /// Home to the body's node: deliver `sig` to the body of home PID `pid`.
    SignalBody {
        pid: i32,
        sig: i32,
        /// Deliver it with this siginfo (as the home saw it) rather than as a plain kill.
        #[serde(default)]
        queued: Option<SigQueued>,
        /// The home PID of the tree's root, when `pid` is the process's PID in the tree's own
        /// PID namespace (the body's number) rather than its home's: a child of a `ferry run`
        /// program, whose namespace numbers it apart from its node. The body is looked for in
        /// that tree only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root: Option<i32>,
    },
    /// Home to a node it took for dead and hears from again: kill the whole body of the tree
    /// whose root is home PID `pid`, as it is now (every process its guest namespaces hold,
    /// those it forked since it left home included). Answered `Done` with what was killed
    /// there, or `Error` (no such body there).
    FenceBody {
        pid: i32,
    },
    /// Body's node to home, and a daemon to its deputies' worker: the body of home PID `pid`
    /// ended, stopped or continued: `status` is the raw wait status its parent there saw.
    BodyStatus {
        pid: i32,
        status: i32,
        /// From the body's node: the home PID of the tree's root, `pid` then being the
        /// process's PID in the tree's own namespace (the body's number), which the home turns
        /// into its deputy's. None: `pid` is the deputy's (and always so to the worker).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root: Option<i32>,
    },
    /// Body's node to home, and a daemon to its deputies' worker: the body of home PID `pid`
    /// is forking (fork, vfork, or clone or clone3 without CLONE_THREAD): make its child a
    /// deputy at home, a child of `pid`'s deputy, and say its PID (`DeputyForked`), which the
    /// body's child then gets in its namespace. Home answers `Error` if it cannot. From the
    /// body's node, `root` is the home PID of the tree's root, `pid` then being the process's
    /// PID in the tree's own namespace (as in `BodyStatus`), and the answer's `pid` the child's
    /// there too; to the deputies' worker, `pid` is the deputy's and `root` None.
    ForkDeputy {
        pid: i32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root: Option<i32>,
    },
    /// Answer to `ForkDeputy`: deputy `pid` was forked from deputy `parent`.
    DeputyForked {
        parent: i32,
        pid: i32,
    },
    /// Deputies' worker to its daemon: no deputy could be forked from deputy `parent`: why.
    ForkRefused {
        parent: i32,
        message: String,
    },
    /// The node a guest left to its home, after the commit: the body of home PID `pid` runs on
    /// `node` now.
    BodyMoved {
        pid: i32,
        node: String,
    },
    /// Home to the body's node: an image of the body of home PID `pid`, which runs on. Answered
    /// with the image in data frames and `End`, then `Done` (or `Error` at any point).
    CheckpointBody {
        pid: i32,
    },
    /// A body's node to its home, after the commit, on a connection of its own: relay pipe
    /// `pipe` (`Pipe::id` of the image, or `Pipe::relay` for a body moving on) of the tree whose
    /// root is home PID `pid`. Answered
    /// `Done` (or `Error`); then data frames flow on it one way, and `End` is end of file.
    ///
    /// On a pipe's relay `at` is where the body's node stands in the relay's byte stream when
    /// it dials again (home restarted, or the connection broke): the bytes it has written into
    /// the body's stand-in (the body reads), or sent (the body writes); `None` on a first
    /// open. Home answers a pipe's relay with `RelayAt` instead of `Done`.
    RelayOpen {
        pid: i32,
        pipe: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<u64>,
    },
    /// Home's answer to a pipe's `RelayOpen`: where the relay's byte stream stands at home. On
    /// a relay the body reads, the offset home sends from (the `at` asked, or on a first open
    /// where the last node's stand-in stopped); on one the body writes, how many bytes home
    /// has received and kept (the body's node sends again from there).
    RelayAt {
        at: u64,
    },
    /// After a body's image (`CheckpointBody`), before `Done`: where each of its pipes' relays
    /// stood in its stream when the body was frozen (relay id, `RelayOpen::at`). Home keeps its
    /// relays' buffers from there, and a tree rebuilt from that image goes on from there.
    RelayMarks {
        relays: Vec<(u32, u64)>,
    },
    /// Inside a pipe's relay: the bytes of the relay's stream (counted as in `RelayAt`) the
    /// sender has put where they survive its peer's daemon dying: from the body's node, those
    /// written into the body's stand-in; from home, those kept in its relay's buffer, which
    /// outlives the daemon.
    RelayAck {
        at: u64,
    },
    /// Inside a pipe's relay, the body's node to home, after a commit that moved the body on
    /// to node `to`: the relay switches to `to` (which asks for it with `RelayOpen`). On a
    /// relay the body reads, home stops reading its pipe and answers `RelayHandoff` (its last
    /// data frame is before it); the body's node then sends back what it had taken from home
    /// and the body had not read, and `End`: home sends that to `to` first. On a relay the
    /// body writes, it is the body's node's last frame. On a terminal's or a socket's relay
    /// (both ways), the body's node sends it after the last of what the body wrote, home
    /// answers it, and the body's node sends back what the body had not read, and `End`. See
    /// docs/wire-format.md.
    RelayHandoff {
        to: String,
    },
    /// Inside a pipe's relay, both ways: the short circuit of a pipe whose writer and reader are
    /// both bodies on one node (docs/wire-format.md, "Both ends on one node"). Home to the
    /// relay of the body that writes: stop sending; its node answers `RelayJoin` with the same
    /// `token` after its last data frame and keeps the stand-in for the reader's relay on its
    /// node, or with token 0 (refused: the body is being moved, or its writers are gone). Home
    /// to the relay of the body that reads, after its last data frame: the writer's stand-in
    /// waits on that node under `token`; the node answers `RelayJoin` with the token once all
    /// before it is in the reader's stand-in and it has the writer's stand-in in hand (it then
    /// moves the bytes between the two itself), or with token 0 (refused).
    RelayJoin {
        token: u64,
    },

    // ---- Who may use which machine: owner policy, host grants, eviction ---------------
    /// CLI to its daemon: the owner's policy from now on ("always", "idle", "never"); ends a
    /// drain.
    SetAcceptPolicy {
        policy: String,
    },
    /// CLI to its daemon: `count` hosts for an application of `class`, held for process
    /// `holder` of this node (the host returns when it ends) on behalf of `uid`. Answered by
    /// `HostsGranted`.
    HostsGet {
        count: u32,
        class: String,
        uid: u32,
        holder: i32,
    },
    HostsGranted(HostsReport),
    /// CLI to its daemon: give back the hosts `holder` holds (only those of `class`, or only
    /// `hosts`, when given).
    HostsRelease {
        holder: i32,
        class: Option<String>,
        hosts: Vec<String>,
    },
    /// Requester's daemon to a host: lend yourself to `grant` (its requester is the caller).
    /// `reclaim`: no host was free; take yourself back from a user holding more hosts if
    /// fairness says so. Answered by `Done` or `Refused`.
    GrantHost {
        grant: ferry_policy::HostGrant,
        reclaim: bool,
    },
    /// Requester's daemon to a host: `holder` no longer needs it (class None: any).
    ReleaseHost {
        holder: i32,
        class: Option<String>,
    },
    /// CLI to its daemon, and a daemon to node `node`: every guest of `node` leaves (home, or
    /// to another idle node); `drain`: and it takes no new guests until `ferry accept`.
    /// Answered by `Evicted`.
    Evict {
        node: String,
        drain: bool,
    },
    Evicted(EvictReport),
    /// Inside a terminal's relay, home to the body's node: the home terminal's window size
    /// (rows, columns, x and y pixels) changed.
    RelayWinsize {
        size: [u16; 4],
    },
    /// Inside a terminal's relay, the body's node to home: the body changed its terminal's
    /// settings (tcsetattr: `stty raw -echo`, an editor's raw mode); the home terminal takes
    /// them. Fields of `struct termios2`.
    RelayTermios {
        iflag: u32,
        oflag: u32,
        cflag: u32,
        lflag: u32,
        line: u8,
        cc: Vec<u8>,
    },
    // ---- Automatic load balancing (ferry-daemon/src/balancer.rs) --------------------
    /// CLI to daemon: hand PID (a process on this node) to the balancer.
    BalanceAdd {
        pid: i32,
    },
    /// CLI to daemon: the balancer's decisions, answered by `BalanceDecisions`.
    BalanceLog,
    BalanceDecisions(Vec<ferry_policy::balance::Decision>),
    /// CLI to daemon: set these `[balance]` settings (TOML lines) while the daemon runs; empty
    /// to change nothing. Answered by `BalanceSettings`: the whole configuration, as TOML.
    BalanceSet {
        settings: String,
    },
    BalanceSettings {
        toml: String,
    },
    /// A node's balancer to the node it just sent a process to: the guest with this home
    /// identity is the balancer's there too (its minimum stay starts now).
    BalanceAdopt {
        home_node: String,
        home_pid: i32,
    },
    /// Body's node to home, and a daemon to its deputies' worker: process `pid` of a body made
    /// system call `nr` with `args`, one that only its home can answer (a signal to a process
    /// there: `kill`, `tkill`, `tgkill`, `rt_sigqueueinfo`, `rt_tgsigqueueinfo`): its deputy
    /// makes it at home, injected, and the result goes back (`HomeCalled`). `data`: the
    /// siginfo the call's pointer argument names, read from the body. `uids`: the calling
    /// thread's real, effective and saved uids in the body, which must be its deputy's. `root`
    /// as in `ForkDeputy` (None to the worker, `pid` then being the deputy's).
    HomeCall {
        pid: i32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root: Option<i32>,
        nr: i64,
        args: Vec<u64>,
        #[serde(default)]
        data: ByteBuf,
        uids: [u32; 3],
    },
    /// Home to the node running the body of the tree whose root is home PID `pid`: the root's
    /// parent, group or session at home changed (its parent died and it was reparented, or it
    /// was moved to another group from home): its guest init answers `getppid`, `getpgid`,
    /// `getsid` with these from now on. `Done` or `Error`.
    BodyIds {
        pid: i32,
        ids: HomeIds,
    },
    /// Answer to `HomeCall`: what the call returned at home (a value, or -errno), or why it
    /// was not made (`error`; the body's call then fails with EPERM).
    HomeCalled {
        pid: i32,
        ret: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
}

/// A pipe the moving tree shares with a process outside it: a descriptor through which the
/// tree holds it at home, and which way its data flows.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
pub struct RelayedPipe {
    pub pipe: u32,
    pub pid: i32,
    pub fd: i32,
    /// The tree holds the read end: data flows from home to the body.
    pub body_reads: bool,
    /// A terminal at home (`pipe` is `RELAY_TTY` | its pts number): relayed both ways.
    #[serde(default)]
    pub tty: bool,
}

impl Msg {
    pub fn error(message: impl Into<String>) -> Msg {
        Msg::Error {
            message: message.into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MigrateOffer {
    /// Chosen by the source, unique on it.
    pub id: u64,
    pub from_node: String,
    /// Where the tree started and the PID it had there (it keeps that PID everywhere).
    pub home_node: String,
    pub home_pid: i32,
    pub command: String,
    pub uid: u32,
    /// Resident memory of the tree, for the destination's admission check.
    pub memory_bytes: u64,
    pub since_unix_ms: u64,
    /// What its home says of the tree's root (read there when it first left, carried on
    /// since): the answers of its body's forwarded calls. None from an older source: then the
    /// body's calls are answered where it runs.
    #[serde(default)]
    pub home_ids: Option<HomeIds>,
    /// The compressed frames the source can send (`frame::LZ4`); none from an older source.
    #[serde(default)]
    pub compress: Vec<String>,
    /// The tree's private anonymous memory is not in the image: the destination serves it
    /// from the source as it is touched (`Msg::PageWant`), and pushes the rest.
    #[serde(default)]
    pub lazy: bool,
    /// A body going home says whether its tree can be rebuilt there in place of its deputies
    /// (the ordinary process again, under its PID): every process root, running, unconfined
    /// by chroot, with no socket and no terminal (what that rebuild does not cover yet). If
    /// not, it comes home as a body beside its deputies, as it would go to any node.
    #[serde(default)]
    pub in_place: bool,
    /// A tree its home rebuilds from its last checkpoint after its node died: what the home
    /// says of it (listed with it, [`ProcInfo::recovered`]). None for a migration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered: Option<String>,
    /// The tree holds a device of the source's machine (its console, a virtual terminal,
    /// /dev/kmsg open for reading): taken only by a node on the same machine and boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_bound: Option<Box<MachineBound>>,
}

/// A device of the source's machine held by a tree on offer ([`MigrateOffer::machine_bound`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MachineBound {
    /// The source's kernel boot id (/proc/sys/kernel/random/boot_id).
    pub boot_id: String,
    /// Which descriptor, of which process: "PID 12 fd 3 (/dev/console)".
    pub what: String,
}

/// What a signal sent with `sigqueue` (or another negative `si_code`, but SI_TKILL) carried, as
/// the home saw it: a body receives it with the same si_code, sender and value. (The kernel
/// lets nobody forge a kill()'s SI_USER or a kernel's code: those arrive as from nobody.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SigQueued {
    pub code: i32,
    pub pid: i32,
    pub uid: u32,
    pub value: u64,
}

/// A moved root's identities at home: the home's host name, and the root's parent, process
/// group and session there (its PID is the `home_pid` beside).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HomeIds {
    pub hostname: String,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Rebuilt {
    /// Host PID of the tree's root on the destination.
    pub pid: i32,
    pub load_ms: f64,
    pub restore_ms: f64,
    /// The restore worker's descriptor of the relay's end of each relayed pipe, by
    /// `Pipe::id`: the daemon takes them (pidfd_getfd) before the tree is let go.
    #[serde(default)]
    pub relays: Vec<(u32, i32)>,
    /// What each relayed socket the body got was at home (its inode and names), which the
    /// body's node needs to move it on (docs/wire-format.md, "Moving on with relays").
    #[serde(default)]
    pub relay_names: Vec<RelayName>,
    /// When the rebuild's steps ended ([`Stamp`]).
    #[serde(default)]
    pub timeline: Vec<Stamp>,
}

/// A relayed socket of a rebuilt body: its relay's id at home, and the line "INO LOCAL PEER
/// HOME_INO" (the body's socket inode, the names and inode of the original at home, names in
/// hex) its supervisor was given.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RelayName {
    pub relay: u32,
    pub line: String,
}

/// A moment of a migration, for its report's timeline: the step that just ended, and when
/// (µs since the epoch on the clock of the machine where it ended: steps of two nodes compare
/// exactly only where they share a clock, as the nodes of a local cluster do).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Stamp {
    pub what: String,
    pub unix_us: u64,
}

impl Stamp {
    /// `what` ended now.
    pub fn now(what: &str) -> Stamp {
        Stamp {
            what: what.to_string(),
            unix_us: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSpec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub umask: u32,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// (resource, soft, hard)
    pub rlimits: Vec<(u32, u64, u64)>,
    /// Set when the caller's stdin and stdout are a terminal: the program gets a pty this size.
    pub tty: Option<(u16, u16)>,
    pub home_node: String,
    /// The PID of `ferry run` at home: the program's identity there.
    pub home_pid: i32,
    /// `--on NODE`: where to run; None: `--auto`, the idlest node that accepts guests.
    #[serde(default)]
    pub target: Option<String>,
    /// With `--auto`: never the caller's own node.
    #[serde(default)]
    pub elsewhere: bool,
    /// With `tty`: the caller's stderr is that terminal too (else it is streamed apart, as 2).
    #[serde(default)]
    pub stderr_tty: bool,
    /// Signals the caller ignores (bit n-1 for signal n): the program starts ignoring them.
    #[serde(default)]
    pub sig_ignored: u64,
    /// The caller's signal mask, which the program starts with.
    #[serde(default)]
    pub sig_blocked: u64,
    /// `--balance`: the node that runs the program hands it to its balancer, which may move
    /// it later (its caller's stream follows it).
    #[serde(default)]
    pub balance: bool,
    /// `--checkpoint-every SECS`: how often the program's tree is checkpointed once it has
    /// left the node running it (its home, in the sense of its deputies), overriding that
    /// node's `checkpoint_every_secs` (0: never). None: the node's default. (An f32: a
    /// `Msg` must stay small.)
    #[serde(default)]
    pub checkpoint_every_secs: Option<f32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeInfo {
    pub name: String,
    pub addr: String,
    /// "self", "alive" or "down".
    pub state: String,
    pub load: Option<NodeLoad>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcInfo {
    pub home_node: String,
    pub node: String,
    /// The PID the process has at home, and sees itself.
    pub home_pid: i32,
    /// Its PID on the node where it runs.
    pub pid: i32,
    pub uid: u32,
    pub command: String,
    /// "running", "migrating", "exited"
    pub state: String,
    /// "migrated" or "remote-exec"
    pub kind: String,
    pub since_unix_ms: u64,
    /// A body's identities at home (see [`MigrateOffer::home_ids`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home_ids: Option<HomeIds>,
    /// What a body costs: the system calls of its tree that Ferry's filter handed to its
    /// supervisor on this node (docs/syscalls.md, "forwarded"), and the supervisor's time on
    /// them, in microseconds. Zero for a process that is not a body.
    #[serde(default)]
    pub forwarded_calls: u64,
    #[serde(default)]
    pub forwarded_us: u64,
    /// A `ferry run` program's own checkpoint interval (`ferry run --checkpoint-every`), for
    /// when its tree leaves the node running it (0: never); None: that node's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_every_secs: Option<f64>,
    /// A tree rebuilt from its home's last checkpoint after the node running it died: which
    /// node died, and the nodes passed over for it, with why ("after node b died; passed
    /// over: c: why"). None otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovered: Option<String>,
    /// The PIDs of the tree's deputies at home (its root's, and those forked since it left),
    /// filled in by its home when the home is the node asked (`ferry ps` there).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deputies: Vec<i32>,
}

/// The cluster as one node sees it (`Msg::View`). Every struct here only ever gains fields,
/// each `#[serde(default)]`, so views (`ferry top`, the page) add columns as counters appear.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClusterView {
    /// The node that answered, and when (milliseconds since the Unix epoch).
    pub node: String,
    pub taken_unix_ms: u64,
    /// Every node this node knows (empty in a peer's `LocalView` answer).
    pub nodes: Vec<NodeInfo>,
    pub processes: Vec<ProcView>,
    /// In a peer's `LocalView` answer: what the trees that left that node cost it. Merged into
    /// `processes[].cost` in the answer to `Cluster`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub home_costs: Vec<HomeCost>,
    /// Nodes that did not answer in time: their guests are missing from `processes`.
    #[serde(default)]
    pub unanswered: Vec<String>,
}

/// A process under Ferry, as the node running it sees it, and what it costs its home.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcView {
    #[serde(flatten)]
    pub info: ProcInfo,
    /// CPU use of the tree (its root and descendants), percent of one CPU, since the previous
    /// look (or since it started, at the first).
    #[serde(default)]
    pub cpu_pct: Option<f32>,
    /// The kernel's state of the tree's root where it runs: "R", "S", "D", "T", "Z"...
    #[serde(default)]
    pub run_state: Option<String>,
    /// What it costs its home node, as the home reports it (None: nothing is kept there, or
    /// the home did not answer).
    #[serde(default)]
    pub cost: Option<HomeCost>,
}

/// What a tree that left its home costs that home: the deputies kept there, and the work
/// they do for it. Counters a home does not keep are None.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HomeCost {
    /// The home PIDs of the tree's deputies (its root's among them).
    pub pids: Vec<i32>,
    /// The node running the tree's body, as the home believes.
    pub body_node: String,
    /// Deputies still alive at home.
    pub deputies: u32,
    /// Signals sent to the deputies and forwarded to the body.
    pub signals_forwarded: u64,
    /// System calls the home performed for the body (where the home forwards them).
    #[serde(default)]
    pub calls_forwarded: Option<u64>,
    /// Bytes the home relayed for the body (where known).
    #[serde(default)]
    pub bytes_relayed: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MigrateReport {
    pub pid: i32,
    pub from: String,
    pub to: String,
    /// The tree's PID on the destination.
    pub dest_pid: i32,
    /// From the moment the tree stopped at the source until it ran at the destination.
    pub freeze_ms: f64,
    pub preflight_ms: f64,
    pub offer_ms: f64,
    /// Capture at the source, streamed and loaded at the destination as it arrives.
    pub transfer_ms: f64,
    pub restore_ms: f64,
    pub commit_ms: f64,
    pub total_ms: f64,
    pub image_bytes: u64,
    /// Bytes written to the connection, framing included (TLS adds its own few percent).
    pub wire_bytes: u64,
    /// How the stream was compressed on the wire ("lz4", frames that pay only), or "" (not).
    #[serde(default)]
    pub compression: String,
    /// The destination's restore worker: from its start until the image was loaded (it reads
    /// the stream as it comes, so this spans the transfer), then rebuilding the tree.
    #[serde(default)]
    pub dest_load_ms: f64,
    #[serde(default)]
    pub dest_rebuild_ms: f64,
    /// How memory moved, and why (absent from older daemons).
    #[serde(default)]
    pub memory: Box<MemoryPlan>,
    /// From the start of the migration until the copy ran on the destination (the source's
    /// clock: when the destination's `Resumed` arrived).
    #[serde(default)]
    pub resumed_ms: f64,
    /// A lazy migration's lazy phase: pages sent by fault and by push, and when the source
    /// was released.
    #[serde(default)]
    pub lazy: Option<Box<LazyReport>>,
    /// When each step of the migration ended, the source's, its capture worker's and the
    /// destination's restore worker's, in order ([`Stamp`]): where the freeze goes.
    #[serde(default)]
    pub timeline: Vec<Stamp>,
}

/// The lazy phase of a migration (`--memory lazy`), as the destination's page server saw it,
/// and when the source let go of its memory.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LazyReport {
    /// Bytes the copy was owed when it was handed over.
    pub owed_bytes: u64,
    /// Fault messages read, and of them those already served (another thread's fault or the
    /// push had brought the page).
    pub faults: u64,
    pub faults_already_served: u64,
    /// Faults whose page was already on its way (asked for by the push or another fault's
    /// window): served by that answer, never asked for twice.
    #[serde(default)]
    pub faults_on_the_way: u64,
    /// Requests made to the source, the most outstanding at once (they are pipelined), and
    /// the largest window of pages one fault asked for (it doubles on sequential faults).
    #[serde(default)]
    pub asks: u64,
    #[serde(default)]
    pub max_asks_in_flight: u64,
    #[serde(default)]
    pub max_fault_window_pages: u64,
    /// Pages sent in answer to faults (with their prefetched neighbours), and by the push.
    pub fault_pages: u64,
    pub pushed_pages: u64,
    /// Faults answered with a zero page (no data there).
    pub zero_pages: u64,
    /// Pages the source named as holes (it holds none of them: never touched, or dropped):
    /// not sent, they read as zeros. (Counted in `fault_pages` and `pushed_pages` too, which
    /// count the pages asked for.)
    #[serde(default)]
    pub hole_pages: u64,
    /// Forks, mremaps, munmaps and madvise(DONTNEED)s followed during the lazy phase.
    pub forked: u64,
    pub remaps: u64,
    pub unmaps: u64,
    pub removes: u64,
    /// Address spaces that ended still owed pages.
    pub ended_owing: u64,
    /// Time spent answering faults, in all (round trips to the source included).
    pub fault_service_us: u64,
    /// Bytes received from the source.
    pub source_bytes: u64,
    /// On the destination: from the hand-over (during the rebuild) until the last page was in.
    pub dependency_ms: f64,
    /// On the source: from the copy's resume until the source was released (the original
    /// killed, or left as a deputy), its memory no longer needed.
    pub source_released_after_resume_ms: f64,
    /// A hybrid migration's pre-copied pages, which the destination's page server copies in
    /// after the copy runs, never asking the source: bytes the copy still lacked when it was
    /// handed over, pages copied in answer to faults and by the push before the source was
    /// released, and bytes still to be copied then (they went in after).
    #[serde(default)]
    pub local_owed_bytes: u64,
    #[serde(default)]
    pub local_fault_pages: u64,
    #[serde(default)]
    pub local_pushed_pages: u64,
    #[serde(default)]
    pub local_pending_bytes: u64,
}

/// How a migration moved memory: the mode used, why, and its pre-copy rounds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct MemoryPlan {
    /// "eager" (all memory during the freeze), "precopy", "lazy" or "hybrid" (pre-copy rounds,
    /// then what was dirtied since the last one lazily).
    pub mode: String,
    /// Why this mode (for `auto`: the size, dirty rate and link speed it was chosen from).
    pub reason: String,
    /// The pre-copy rounds, with the tree running.
    pub rounds: Vec<PrecopyRound>,
    /// The tree was stopped this long to start dirty tracking (before the rounds).
    pub setup_stop_ms: f64,
    /// Bytes of memory the image took from the rounds instead of carrying them.
    pub inherited_bytes: u64,
    /// Bytes of memory the image itself carried (sent during the freeze).
    pub frozen_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct PrecopyRound {
    /// Bytes found written since the round before (the first: all private memory).
    pub dirty_bytes: u64,
    /// Bytes sent (dirty pages holding data, all-zero pages left out).
    pub sent_bytes: u64,
    pub ms: f64,
}

/// What a request for hosts got.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HostsReport {
    pub class: String,
    pub uid: u32,
    pub holder: i32,
    /// Granted hosts, longest idle first.
    pub hosts: Vec<String>,
    /// Hosts taken back from another user for this request (fairness), with that user.
    pub reclaimed: Vec<(String, u32)>,
    /// Hosts that refused, and why (a stale view, a race with another requester).
    pub refused: Vec<(String, String)>,
    /// Nodes the choice was made over.
    pub considered: u32,
    /// Choosing (the policy alone), and the whole request through the daemon.
    pub select_us: f64,
    pub total_ms: f64,
}

/// How a node was freed of its guests.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EvictReport {
    pub node: String,
    /// "owner input", "ferry evict", "ferry drain", "reclaimed for uid N".
    pub reason: String,
    pub draining: bool,
    /// From the decision until the last guest had left (or was given up on).
    pub total_ms: f64,
    pub guests: Vec<EvictedGuest>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EvictedGuest {
    pub home_node: String,
    pub home_pid: i32,
    /// Its PID on the evicted node.
    pub pid: i32,
    pub uid: u32,
    pub command: String,
    /// Where it went; None: it could not move and still runs on the evicted node (`error`).
    pub to: Option<String>,
    pub ms: f64,
    pub error: Option<String>,
}

/// The variant's name, for logs and errors (never the payload: it may be large or private).
pub fn kind(m: &Msg) -> String {
    let s = format!("{m:?}");
    s.split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("?")
        .to_string()
}
