//! Crash at every point, power loss and failed steps (feature `fault-injection`).
//!
//! A child process runs a scripted workload (puts, sessions, compaction, gc,
//! reopen; with `durability = batch` also flushes) with a fault armed at its
//! Nth durable step (write, fdatasync, rename, unlink, index commit); it
//! appends "ack k" to a side file after each step of the workload returns.
//! The parent then reopens the store and compares what it holds with a model
//! of the workload written here, independently of the engine ([`Model`]):
//! which blocks each step leaves (what a put adds, what gc evicts), so how
//! many tokens of each sequence are stored and how many blocks in all, and
//! which sessions. Fault-free runs that stop after k steps must hold exactly
//! the model's state k. After a fault, with `sync` only the step in flight may
//! or may not have reached its commit, so every sequence's stored prefix, and
//! the block count, must lie between the model's states k and k + 1; with
//! `batch`, between the last acknowledged durable point (a flush, session
//! save, compaction, gc or reopen) and k + 1. Every hit must be bit-exact,
//! sessions must match one of those states, and `verify` must find no index
//! entry pointing at missing or torn bytes.
//!
//! Every N from 1 to the workload's step count is exercised in three modes:
//! process crash (SIGKILL before the step), power loss (unsynced bytes cut at
//! a seeded random length or zeroed, unsynced directory entries dropped; the
//! hot-tier arena is lost too) and a failed step (EIO; the process goes on,
//! must report a typed error, from the step that failed or from the close
//! that follows, and stays consistent).

use kvstore::fault::{self, Mode, Op};
use kvstore::{Codec, DType, Durability, Error, Layout, Options, Store};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

mod support;
use support::{kv_for, prefix_matches, seq, NO_PROGRESS};

const CHILD_ENV: &str = "KVSTORE_CRASH_CHILD";

/// Tokens per block.
const B: usize = 4;
/// Bytes of one block's KV: `[L = 8, 2, B, H = 8, D = 128]` of float16.
const BLOCK_BYTES: u64 = 8 * 2 * B as u64 * 8 * 128 * 2;

/// 128 KiB blocks of 4 tokens: eight records fill the smallest segment.
fn layout() -> Layout {
    let l = Layout::new(8, 8, 128, DType::Float16, B as u32).unwrap();
    assert_eq!(l.block_bytes() as u64, BLOCK_BYTES);
    l
}

fn opts(hot_dir: Option<&Path>, durability: Durability) -> Options {
    Options {
        fingerprint: Some("crash-model@1".into()),
        layout: Some(layout()),
        durability,
        // Records of a known size (the model's gc counts on it).
        codec: Codec::Raw,
        // Batch: group commits only at flush, compaction, gc and close (no
        // timer), so every run takes the same steps.
        batch_window: std::time::Duration::from_secs(3600),
        // The workload rolls segments.
        segment_bytes: 1 << 20,
        hot_bytes: hot_dir.map(|_| 8 << 20),
        hot_dir: hot_dir.map(Path::to_path_buf),
        ..Options::default()
    }
}

/// The workload's sequences: several share prefixes (deduplicated blocks).
fn sequences() -> Vec<Vec<u32>> {
    let s0 = seq(1, 12);
    let s1 = [&s0[..8], &seq(2, 8)[..]].concat();
    let s2 = seq(3, 16);
    let s3 = [&s2[..4], &seq(4, 12)[..]].concat();
    let s4 = seq(5, 10);
    let s5 = [&s1[..], &seq(6, 4)[..]].concat();
    let s6 = seq(7, 12);
    let s7 = [&s6[..8], &seq(8, 8)[..]].concat();
    vec![s0, s1, s2, s3, s4, s5, s6, s7]
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Put(usize),
    Session(&'static str, usize),
    DeleteSession(&'static str),
    Compact,
    /// gc down to this many bytes (evicts the least recently used).
    Gc(u64),
    Reopen,
    Flush,
}

impl Step {
    /// Whether it and everything acknowledged before it are durable once it
    /// returns (in batch mode; in sync mode every step is). A session save
    /// commits the blocks put before it, as a flush does, and then itself.
    fn commits(self) -> bool {
        matches!(
            self,
            Step::Flush | Step::Session(..) | Step::Compact | Step::Gc(_) | Step::Reopen
        )
    }
}

const WORKLOAD: &[Step] = &[
    Step::Put(0),
    Step::Put(1),
    Step::Put(2),
    Step::Session("a", 1),
    Step::Put(3),
    Step::Put(4),
    Step::Compact,
    Step::Gc(1 << 20),
    Step::Put(5),
    Step::DeleteSession("a"),
    Step::Session("b", 5),
    Step::Reopen,
    Step::Put(6),
    Step::Put(7),
    Step::Compact,
];

/// The same work with durability "batch": puts are durable at the next
/// flush, session save, compaction, gc or reopen.
const WORKLOAD_BATCH: &[Step] = &[
    Step::Put(0),
    Step::Put(1),
    Step::Flush,
    Step::Put(2),
    Step::Session("a", 1),
    Step::Put(3),
    Step::Put(4),
    Step::Compact,
    Step::Gc(1 << 20),
    Step::Put(5),
    Step::DeleteSession("a"),
    Step::Session("b", 5),
    Step::Reopen,
    Step::Put(6),
    Step::Flush,
    Step::Put(7),
    Step::Compact,
];

fn workload(d: Durability) -> &'static [Step] {
    match d {
        Durability::Batch => WORKLOAD_BATCH,
        _ => WORKLOAD,
    }
}

fn do_step(
    store: &mut Store,
    step: Step,
    dir: &Path,
    hot: Option<&Path>,
    d: Durability,
) -> kvstore::Result<()> {
    let seqs = sequences();
    let l = layout();
    match step {
        Step::Put(i) => store
            .put(&seqs[i], &kv_for(&l, &seqs[i]), seqs[i].len(), b"")
            .map(drop),
        Step::Session(name, i) => store
            .save_session(name, &seqs[i], &kv_for(&l, &seqs[i]), seqs[i].len())
            .map(drop),
        Step::DeleteSession(name) => store.delete_session(name).map(drop),
        Step::Compact => store.compact(NO_PROGRESS).map(drop),
        Step::Gc(bytes) => store.gc(Some(bytes), None, NO_PROGRESS).map(drop),
        Step::Reopen => {
            store.close()?;
            *store = Store::open(dir, opts(hot, d))?;
            Ok(())
        }
        Step::Flush => store.flush(),
    }
}

/// What the parent asks of a child run.
struct Plan {
    mode: Option<Mode>,
    nth: u64,
    stop_after: usize,
}

/// The child side: runs the workload under the armed plan.
#[test]
#[ignore = "the child process of the crash-point tests; they run it"]
fn crash_child() {
    let spec = std::env::var(CHILD_ENV)
        .unwrap_or_else(|_| panic!("run by the crash-point tests, which set {CHILD_ENV}"));
    let f: Vec<&str> = spec.split(';').collect();
    let (dir, hot) = (PathBuf::from(f[0]), PathBuf::from(f[1]));
    let (mode, nth, seed, stop_after): (&str, u64, u64, usize) = (
        f[2],
        f[3].parse().unwrap(),
        f[4].parse().unwrap(),
        f[5].parse().unwrap(),
    );
    let d = Durability::parse(f[6]).unwrap();
    let mut acks = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.with_extension("acks"))
        .unwrap();
    let mut say = |line: String| acks.write_all(format!("{line}\n").as_bytes()).unwrap();
    match mode {
        "crash" => fault::arm(nth, Mode::Crash),
        "power" => fault::arm(nth, Mode::PowerLoss { seed }),
        "fail" => fault::arm(nth, Mode::Fail),
        _ => fault::count_only(),
    }
    let hot = Some(hot.as_path());
    let mut store = match Store::open(&dir, opts(hot, d)) {
        Ok(s) => s,
        Err(e) => {
            say(format!("err open {}", kind(&e)));
            return;
        }
    };
    for (k, step) in workload(d).iter().take(stop_after).enumerate() {
        match do_step(&mut store, *step, &dir, hot, d) {
            Ok(()) => say(format!("ack {k}")),
            Err(e) => {
                say(format!("err {k} {}", kind(&e)));
                // Writes after a failed fdatasync must keep failing.
                let extra = seq(99, 8);
                let again = store.put(&extra, &kv_for(&layout(), &extra), 8, b"");
                say(format!("after {}", again.err().map_or("ok", |e| kind(&e))));
                break;
            }
        }
    }
    let closed = store.close();
    say(format!(
        "closed {}",
        closed.err().map_or("ok", |e| kind(&e))
    ));
    let trace: Vec<&str> = fault::trace()
        .iter()
        .map(|op| match op {
            Op::Write => "W",
            Op::Sync => "S",
            Op::Rename => "R",
            Op::Unlink => "U",
            Op::Commit => "C",
        })
        .collect();
    say(format!("steps {} {}", fault::steps(), trace.join("")));
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::Io { .. } => "Io",
        Error::Poisoned(_) => "Poisoned",
        Error::StoreFull(_) => "StoreFull",
        Error::StoreClosed(_) => "StoreClosed",
        Error::Index(_) => "Index",
        Error::CorruptStore { .. } => "CorruptStore",
        _ => "other",
    }
}

struct Outcome {
    exit_ok: bool,
    acked: usize,
    lines: Vec<String>,
}

fn spawn(
    root: &Path,
    name: &str,
    mode: &str,
    plan: &Plan,
    seed: u64,
    d: Durability,
) -> (PathBuf, Outcome) {
    let dir = root.join(name);
    let hot = root.join(format!("{name}.hot"));
    std::fs::create_dir_all(&hot).unwrap();
    let spec = format!(
        "{};{};{};{};{};{};{}",
        dir.display(),
        hot.display(),
        mode,
        plan.nth,
        seed,
        plan.stop_after,
        d.name()
    );
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "crash_child",
            "--test-threads=1",
            "-q",
        ])
        .env(CHILD_ENV, spec)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    let lines: Vec<String> = std::fs::read_to_string(dir.with_extension("acks"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let acked = lines.iter().filter(|l| l.starts_with("ack ")).count();
    if matches!(plan.mode, Some(Mode::PowerLoss { .. })) {
        // The hot tier lives in memory: a power cut takes it, a crash does not.
        std::fs::remove_dir_all(&hot).unwrap();
        std::fs::create_dir_all(&hot).unwrap();
    }
    (
        dir,
        Outcome {
            exit_ok: status.success(),
            acked,
            lines,
        },
    )
}

/// What a store holds: each sequence's stored prefix in tokens (every hit
/// checked bit-exact), the blocks in the index, and the sessions.
#[derive(Clone, Debug, PartialEq)]
struct State {
    prefix: Vec<usize>,
    blocks: u64,
    sessions: BTreeMap<String, Vec<u32>>,
}

// ---------------------------------------------------------------- the model

/// A block as the model names it: the tokens of its sequence from the first
/// through its own last (what its id is a function of).
type Chain = Vec<u32>;

/// What the workload must leave, step by step, worked out from what each
/// step promises, not from the engine:
///
/// - a put (a session save too) stores every full block of its tokens not
///   stored yet; a block already stored is neither written again nor counted
///   as used;
/// - gc down to `bytes` evicts blocks, least recently used first (a block is
///   used when the put that stored it ran, and the later blocks of one put
///   count as older than its earlier ones, so a chain loses its tail before
///   its head), until the records left fit in `bytes`;
/// - a session save binds its name to its tokens, a delete unbinds it;
/// - flush, compaction and reopen change nothing a reader can see.
#[derive(Clone, Debug, Default)]
struct Model {
    /// Stored blocks, each with (the put that stored it, its index there).
    blocks: BTreeMap<Chain, (usize, usize)>,
    sessions: BTreeMap<String, Vec<u32>>,
    puts: usize,
}

/// Bytes a block's record takes on disk, at least and at most, from the
/// format: its raw payload (`Codec::Raw`), the 80-byte record header and
/// the block's token ids, and less than 4 KiB of zeros before them (a
/// version-2 record puts its payload on a 4 KiB boundary).
const RECORD_BYTES: (u64, u64) = (
    BLOCK_BYTES + 80 + 4 * B as u64,
    BLOCK_BYTES + 80 + 4 * B as u64 + 4095,
);

impl Model {
    fn put(&mut self, tokens: &[u32]) {
        self.puts += 1;
        for j in 0..tokens.len() / B {
            self.blocks
                .entry(tokens[..(j + 1) * B].to_vec())
                .or_insert((self.puts, j));
        }
    }

    fn apply(&mut self, step: Step) {
        let seqs = sequences();
        match step {
            Step::Put(i) => self.put(&seqs[i]),
            Step::Session(name, i) => {
                self.put(&seqs[i]);
                self.sessions.insert(name.to_string(), seqs[i].clone());
            }
            Step::DeleteSession(name) => {
                self.sessions.remove(name);
            }
            Step::Gc(bytes) => {
                let keep = (bytes / RECORD_BYTES.1) as usize;
                assert_eq!(
                    keep,
                    (bytes / RECORD_BYTES.0) as usize,
                    "the model's gc limit must fix how many records fit"
                );
                let mut by_use: Vec<(Chain, (usize, usize))> =
                    std::mem::take(&mut self.blocks).into_iter().collect();
                // Most recently used first: a later put, then an earlier block.
                by_use.sort_by_key(|(_, (put, j))| (std::cmp::Reverse(*put), *j));
                by_use.truncate(keep);
                self.blocks = by_use.into_iter().collect();
            }
            Step::Compact | Step::Reopen | Step::Flush => {}
        }
    }

    fn state(&self) -> State {
        let prefix = sequences()
            .iter()
            .map(|s| {
                let stored = (0..s.len() / B)
                    .take_while(|&j| self.blocks.contains_key(&s[..(j + 1) * B]))
                    .count();
                stored * B
            })
            .collect();
        State {
            prefix,
            blocks: self.blocks.len() as u64,
            sessions: self.sessions.clone(),
        }
    }
}

/// The model's state after k steps of the workload, for every k.
fn model_states(d: Durability) -> Vec<State> {
    let mut m = Model::default();
    let mut states = vec![m.state()];
    for step in workload(d) {
        m.apply(*step);
        states.push(m.state());
    }
    states
}

#[test]
fn the_model_states_what_the_workload_leaves() {
    // Worked by hand, as a check of the model itself: block counts of the
    // sequences 3, 4, 4, 4, 2, 5, 3, 4 with shared prefixes; gc keeps 7.
    let s = model_states(Durability::Sync);
    let counts: Vec<u64> = s.iter().map(|s| s.blocks).collect();
    assert_eq!(
        counts,
        [0, 3, 5, 9, 9, 12, 14, 14, 7, 12, 12, 12, 12, 15, 17, 17]
    );
    // After gc: s0 and s1 gone, s2's first two blocks and all of s3 and s4.
    assert_eq!(s[8].prefix, [0, 0, 8, 16, 8, 0, 0, 0]);
    // s0 lost its third block to gc, and no later put stores it again.
    assert_eq!(s[15].prefix, [8, 16, 8, 16, 8, 20, 12, 16]);
    assert_eq!(s[15].sessions.keys().collect::<Vec<_>>(), ["b"]);
}

// ------------------------------------------------------------ observation

/// What the store at `dir` holds, read through a handle that is kept open
/// for [`still_writable`]; every hit is checked bit-exact and `verify` must
/// find nothing wrong.
fn observe(dir: &Path, hot: Option<&Path>) -> Result<(State, Store), String> {
    let store =
        Store::open(dir, opts(hot, Durability::Sync)).map_err(|e| format!("reopen failed: {e}"))?;
    let l = layout();
    let blocks = store.stats().map_err(|e| e.to_string())?.blocks;
    let mut prefix = Vec::new();
    for s in sequences() {
        let n = store.stored_prefix(&s, b"").map_err(|e| e.to_string())?;
        let mut out = vec![0u8; l.kv_bytes(s.len()).unwrap()];
        let m = store
            .get_into(&s, b"", &mut out, s.len())
            .map_err(|e| e.to_string())?;
        if m != n {
            return Err(format!("stored_prefix {n} but get returned {m} tokens"));
        }
        if !prefix_matches(&l, &out, s.len(), &s, m) {
            return Err("WRONG BYTES returned by get".into());
        }
        prefix.push(n);
    }
    let mut sessions = BTreeMap::new();
    for (name, _) in store.sessions().map_err(|e| e.to_string())? {
        let t = store.session_tokens(&name).map_err(|e| e.to_string())?;
        sessions.insert(name, t);
    }
    let report = store.verify(NO_PROGRESS).map_err(|e| e.to_string())?;
    if !report.damaged.is_empty() {
        return Err(format!("verify found damage: {:?}", report.damaged));
    }
    if let Some(p) = report.problems.iter().find(|p| !p.contains("orphan")) {
        return Err(format!("verify found a problem: {p}"));
    }
    let state = State {
        prefix,
        blocks,
        sessions,
    };
    Ok((state, store))
}

/// The recovered store takes a new put, which reads back; then it closes.
fn still_writable(store: &Store) -> Result<(), String> {
    let l = layout();
    let fresh = seq(1234, 8);
    store
        .put(&fresh, &kv_for(&l, &fresh), 8, b"")
        .map_err(|e| format!("put after recovery failed: {e}"))?;
    let mut out = vec![0u8; l.kv_bytes(8).unwrap()];
    let m = store
        .get_into(&fresh, b"", &mut out, 8)
        .map_err(|e| e.to_string())?;
    if m != 8 || out != kv_for(&l, &fresh) {
        return Err("a block put after recovery does not read back".into());
    }
    store.close().map_err(|e| format!("close failed: {e}"))
}

/// Fault-free runs that stop after each k steps, each against the model's
/// state k; returns the trace of the durable steps of the whole workload.
fn reference(root: &Path, d: Durability, model: &[State]) -> Vec<u8> {
    let (mut trace, mut unwritable) = (Vec::new(), Vec::new());
    let steps = workload(d).len();
    assert_eq!(
        model.len(),
        steps + 1,
        "a model state per step, and the start"
    );
    for (k, want) in model.iter().enumerate() {
        let plan = Plan {
            mode: None,
            nth: 0,
            stop_after: k,
        };
        let (dir, out) = spawn(root, &format!("ref{k}"), "count", &plan, 0, d);
        assert!(
            out.exit_ok && out.acked == k,
            "reference run {k}: {:?}",
            out.lines
        );
        if k == steps {
            let last = out.lines.last().unwrap();
            trace = last.split(' ').nth(2).unwrap_or("").as_bytes().to_vec();
        }
        let (got, store) = observe(&dir, None).unwrap_or_else(|e| panic!("reference {k}: {e}"));
        assert_eq!(
            got,
            *want,
            "a fault-free run of {k} steps ({:?}) left what the model does not",
            &workload(d)[..k]
        );
        // Checked once every state has been held against the model.
        if let Err(e) = still_writable(&store) {
            unwritable.push(format!("reference {k}: {e}"));
        }
    }
    assert!(unwritable.is_empty(), "{}", unwritable.join("\n"));
    trace
}

/// The recovered state must sit, sequence by sequence and in its block
/// count, between the model's states from the last durable point to the end
/// of the step in flight (`acked` steps done). With `sync` the last durable
/// point is the last acknowledged step; with `batch` it is the last
/// acknowledged step that commits (see [`Step::commits`]). Sessions must be
/// those of one of these states. `extra`: the blocks of the child's put after
/// a failed step (see [`extra_blocks`]).
fn check_between(
    states: &[State],
    steps: &[Step],
    d: Durability,
    acked: usize,
    extra: std::ops::RangeInclusive<u64>,
    got: &State,
) -> Result<(), String> {
    let floor = match d {
        Durability::Batch => (0..acked)
            .rev()
            .find(|&j| steps[j].commits())
            .map_or(0, |j| j + 1),
        _ => acked,
    };
    let allowed = &states[floor..=(acked + 1).min(states.len() - 1)];
    let range = |f: &dyn Fn(&State) -> u64| {
        let lo = allowed.iter().map(f).min().unwrap();
        let hi = allowed.iter().map(f).max().unwrap();
        lo..=hi
    };
    for (i, n) in got.prefix.iter().enumerate() {
        let r = range(&|s| s.prefix[i] as u64);
        if !r.contains(&(*n as u64)) {
            return Err(format!(
                "sequence {i}: {n} tokens stored, the model allows {r:?} after {acked} acked steps"
            ));
        }
    }
    let r = range(&|s| s.blocks);
    let r = r.start() + extra.start()..=r.end() + extra.end();
    if !r.contains(&got.blocks) {
        return Err(format!(
            "{} blocks stored, the model allows {r:?} after {acked} acked steps",
            got.blocks
        ));
    }
    if !allowed.iter().any(|s| s.sessions == got.sessions) {
        return Err(format!(
            "sessions {:?} match no state from step {floor} to {}",
            got.sessions.keys().collect::<Vec<_>>(),
            acked + 1
        ));
    }
    Ok(())
}

/// After a failed step the child puts one more sequence of 2 blocks (see
/// `crash_child`), stored if that put returned well: durable at once with
/// `sync`, with `batch` once the close after it succeeded.
fn extra_blocks(out: &Outcome, d: Durability) -> std::ops::RangeInclusive<u64> {
    let put_ok = out.lines.iter().any(|l| l == "after ok");
    let closed_ok = out.lines.iter().any(|l| l == "closed ok");
    match (put_ok, d == Durability::Sync || closed_ok) {
        (false, _) => 0..=0,
        (true, true) => 2..=2,
        (true, false) => 0..=2,
    }
}

/// The errors a failed durable step may be reported as.
const TYPED: [&str; 3] = ["Io", "Poisoned", "StoreFull"];

/// A child whose Nth durable step failed: it must have said so with a typed
/// error, from the workload step in flight or from the close after the
/// workload (whose durable steps the trace includes too).
fn check_failure_reported(out: &Outcome) -> Result<(), String> {
    if !out.exit_ok {
        return Err(format!("child died: {:?}", out.lines));
    }
    let err = out.lines.iter().find(|l| l.starts_with("err "));
    let closed = out.lines.iter().find(|l| l.starts_with("closed "));
    let kind = match (err, closed) {
        (Some(e), _) => e.split(' ').nth(2).unwrap_or(""),
        (None, Some(c)) if c != "closed ok" => c.split(' ').nth(1).unwrap_or(""),
        _ => {
            return Err(format!(
                "the failed step was reported by no step and not by close: {:?}",
                out.lines
            ))
        }
    };
    if !TYPED.contains(&kind) {
        return Err(format!("untyped failure {kind:?}: {:?}", out.lines));
    }
    if kind == "Poisoned" && err.is_some() && !out.lines.iter().any(|l| l == "after Poisoned") {
        return Err("a put after a failed fdatasync did not fail".into());
    }
    Ok(())
}

fn sweep(mode_name: &str, d: Durability, make: impl Fn(u64) -> Mode) {
    // On tmpfs where there is one: fsync is free there, and the fault layer,
    // not the disk, decides what a crash keeps.
    let shm = Path::new("/dev/shm");
    let root = if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let states = model_states(d);
    let trace = reference(root.path(), d, &states);
    let steps_of = workload(d);
    let steps = trace.len() as u64;
    assert!(
        steps > 50,
        "the workload should take many durable steps, took {steps}"
    );
    let mut failures = Vec::new();
    for n in 1..=steps {
        let plan = Plan {
            mode: Some(make(n)),
            nth: n,
            stop_after: steps_of.len(),
        };
        let name = format!("{mode_name}{n}");
        let (dir, out) = spawn(root.path(), &name, mode_name, &plan, n, d);
        let op = trace[(n - 1) as usize] as char;
        let res = (|| {
            if mode_name == "fail" {
                check_failure_reported(&out)?;
            } else if out.exit_ok {
                return Err(format!("the child was meant to die: {:?}", out.lines));
            }
            // The durable state against the model (first: the checks below
            // write to the store).
            let (got, store) = observe(&dir, None)?;
            check_between(&states, steps_of, d, out.acked, extra_blocks(&out, d), &got)?;
            still_writable(&store)?;
            // Through the hot tier the crashed process left (gc and
            // compaction act on disk, so it may hold more): hits bit-exact.
            let hot = root.path().join(format!("{name}.hot"));
            observe(&dir, Some(&hot))
                .and_then(|(_, store)| still_writable(&store))
                .map_err(|e| format!("with the hot tier: {e}"))?;
            Ok(())
        })();
        if let Err(e) = res {
            failures.push(format!(
                "{mode_name} ({}) at step {n} ({op}), {} acked: {e}",
                d.name(),
                out.acked
            ));
        }
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(root.path().join(format!("{name}.hot")));
    }
    eprintln!(
        "{mode_name} ({}): {steps} fault points over {} workload steps ({}), {} failures",
        d.name(),
        steps_of.len(),
        String::from_utf8_lossy(&trace),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn crash_at_every_step() {
    sweep("crash", Durability::Sync, |_| Mode::Crash);
}

#[test]
fn power_loss_at_every_step() {
    sweep("power", Durability::Sync, |n| Mode::PowerLoss { seed: n });
}

#[test]
fn failure_at_every_step() {
    sweep("fail", Durability::Sync, |_| Mode::Fail);
}

#[test]
fn batch_crash_at_every_step() {
    sweep("crash", Durability::Batch, |_| Mode::Crash);
}

#[test]
fn batch_power_loss_at_every_step() {
    sweep("power", Durability::Batch, |n| Mode::PowerLoss { seed: n });
}

#[test]
fn batch_failure_at_every_step() {
    sweep("fail", Durability::Batch, |_| Mode::Fail);
}
