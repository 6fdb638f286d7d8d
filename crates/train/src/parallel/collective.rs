//! The one seam between tvq and the collective engine that joins the
//! processes of a data-parallel run (burn 0.21's `burn-collective`).
//!
//! Everything tvq needs from the engine is two verbs: join the run, and
//! sum a vector of `f32` over every node. The vector is plain host memory,
//! so moving to another engine (burn's successor API, NCCL, MPI) touches
//! this file only.
//!
//! burn-collective's model: a global orchestrator (a websocket server)
//! introduces the nodes to each other; each node serves its tensors on a
//! data port and the sums travel peer to peer (a ring). Node 0 hosts the
//! orchestrator at the coordinator address. The engine has no timeouts of
//! its own, so every call here waits at most [`ClusterSpec::timeout`]; a
//! node that died or never came makes the others fail with
//! [`TrainError::Peer`] instead of hanging.

use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn::{Dispatch, DispatchDevice};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};

use crate::error::TrainError;

/// Where this process stands in a run over several processes (nodes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Number of nodes (processes) in the run.
    pub nodes: usize,
    /// This node's rank, `0..nodes`. Node 0 hosts the coordinator and is
    /// the only one that writes checkpoints, metrics and plots.
    pub rank: usize,
    /// `HOST:PORT` of the coordinator, the same on every node (it uses
    /// `PORT` and `PORT + 1`).
    pub coordinator: String,
    /// Host (name or IP) under which the other nodes reach this one;
    /// `None`: the local address of the route to the coordinator.
    pub host: Option<String>,
    /// First of the two ports of this node's tensor service; `None`:
    /// coordinator port + 2 + 2 x rank.
    pub data_port: Option<u16>,
    /// How long any collective call may wait for the other nodes.
    pub timeout: Duration,
}

impl ClusterSpec {
    /// Checks what can be checked without the network (the rank and the
    /// coordinator address) and returns the coordinator's host and port.
    fn validate(&self) -> Result<(String, u16), TrainError> {
        let bad = |key: &str, reason: String| TrainError::Config {
            key: key.into(),
            reason,
        };
        if self.nodes < 2 {
            return Err(bad(
                "--nodes",
                format!(
                    "is {}; a run over several processes needs at least 2",
                    self.nodes
                ),
            ));
        }
        if self.rank >= self.nodes {
            return Err(bad(
                "--node-rank",
                format!(
                    "is {} but ranks go from 0 to {} with --nodes {}",
                    self.rank,
                    self.nodes - 1,
                    self.nodes
                ),
            ));
        }
        let (host, port) = self
            .coordinator
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
            .filter(|(h, p)| !h.is_empty() && *p > 0)
            .ok_or_else(|| {
                bad(
                    "--coordinator",
                    format!("`{}` is not HOST:PORT", self.coordinator),
                )
            })?;
        Ok((host, port))
    }

    fn data_port(&self, coordinator_port: u16) -> Result<u16, TrainError> {
        match self.data_port {
            Some(p) => Ok(p),
            None => u16::try_from(coordinator_port as usize + 2 + 2 * self.rank).map_err(|_| {
                TrainError::Config {
                    key: "--data-port".into(),
                    reason: "coordinator port + 2 + 2 x rank is past 65535: give the port".into(),
                }
            }),
        }
    }
}

/// Fails with a clear error when `port` cannot be bound on this machine.
fn check_port_free(port: u16, what: &str, flag: &str) -> Result<(), TrainError> {
    TcpListener::bind(("0.0.0.0", port))
        .map(drop)
        .map_err(|e| TrainError::Config {
            key: flag.into(),
            reason: format!("port {port} ({what}) cannot be opened on this machine: {e}"),
        })
}

/// The address of this machine on the route to `host:port` (no packet is sent).
fn local_address_towards(host: &str, port: u16) -> Option<String> {
    let target = (host, port).to_socket_addrs().ok()?.next()?;
    let socket = UdpSocket::bind(if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })
    .ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip().to_string())
}

/// This process's membership of a data-parallel run.
///
/// burn-collective 0.21 hangs on the second global all-reduce of a
/// session: its end-of-reduction barrier (`SyncService::sync`) clears a
/// copy of its list of arrived nodes instead of the list, so the second
/// barrier never completes. Each sum therefore runs in a session of its
/// own (register, all-reduce, finish). Sessions alternate between two
/// coordinators and two data ports per node: a node that has finished
/// session `k` registers `k + 1` at the other coordinator while slower
/// nodes may still be finishing `k`, and by the time session `k + 2`
/// reuses the first coordinator and ports, registering `k + 1` has made
/// every node finish `k` (registration waits for all nodes).
pub struct Collective {
    spec: ClusterSpec,
    peer: PeerId,
    /// The plain device the summed vectors live on during the reduction.
    device: DispatchDevice,
    /// The two session configs, used in turn.
    sessions: [CollectiveConfig; 2],
    /// This node's two tensor-service ports, used in turn.
    own_ports: [u16; 2],
    /// Every node's two tensor-service addresses (`2 * rank + session`),
    /// once met.
    data_ports: Vec<SocketAddrV4>,
    /// Sums done so far.
    calls: std::cell::Cell<u64>,
    /// The end of the last sum's session, still under way on the engine's
    /// thread: node 0, which hosts the coordinator, may exit as soon as it
    /// has its sum (a disagreement, the last checkpoint), and the others
    /// would then wait for the session's end in vain. A node therefore
    /// takes its sum as soon as the reduction gives it and waits for the
    /// session's end only before its next sum.
    finishing: std::cell::RefCell<Option<mpsc::Receiver<EngineResult<()>>>>,
}

/// What a call of the engine gives.
type EngineResult<T> = Result<T, burn_collective::CollectiveError>;

/// The backend the collective runs on: the plain (non-autodiff) one.
type Engine = Dispatch;

impl Collective {
    /// Joins the run: node 0 starts the coordinator. The nodes meet at the
    /// first sum ([`Self::all_reduce_sum`]), which waits at most the timeout.
    pub fn join(spec: &ClusterSpec, device: &DispatchDevice) -> Result<Self, TrainError> {
        let (host, port) = spec.validate()?;
        let data_port = spec.data_port(port)?;
        let coordinator_ports = [
            port,
            port.checked_add(1).ok_or_else(|| TrainError::Config {
                key: "--coordinator".into(),
                reason: "the port must be below 65535 (the coordinator uses it and the next one)"
                    .into(),
            })?,
        ];
        let data_ports = [
            data_port,
            data_port.checked_add(1).ok_or_else(|| TrainError::Config {
                key: "--data-port".into(),
                reason: "the port must be below 65535 (a node uses it and the next one)".into(),
            })?,
        ];
        for p in data_ports {
            check_port_free(p, "this node's tensor service", "--data-port")?;
        }
        if spec.rank == 0 {
            for p in coordinator_ports {
                check_port_free(p, "the coordinator", "--coordinator")?;
            }
            keeping_signal_handlers(|| {
                coordinator_ports
                    .into_iter()
                    .try_for_each(start_coordinator)
            })?;
        }
        let node_host = match &spec.host {
            Some(h) => h.clone(),
            None => local_address_towards(&host, port).unwrap_or_else(|| "127.0.0.1".into()),
        };
        let parse = |s: String| s.parse().expect("any string is an address");
        let session = |i: usize| {
            CollectiveConfig::default()
                .with_num_devices(1)
                .with_num_nodes(spec.nodes as u32)
                .with_global_address(parse(format!("ws://{host}:{}", coordinator_ports[i])))
                .with_node_address(parse(format!("ws://{node_host}:{}", data_ports[i])))
                .with_data_service_port(data_ports[i])
        };
        let mut this = Self {
            spec: spec.clone(),
            peer: PeerId(spec.rank as u32),
            device: device.clone(),
            sessions: [session(0), session(1)],
            own_ports: data_ports,
            data_ports: vec![],
            calls: std::cell::Cell::new(0),
            finishing: std::cell::RefCell::new(None),
        };
        this.data_ports = this.meet(&node_host, data_ports)?;
        Ok(this)
    }

    /// The first sum: every node learns where the others serve their
    /// tensors (IPv4 address and both ports), so that later sessions can
    /// wait for them ([`await_listening`]). In this first session the
    /// engine's race is covered by a grace period instead.
    fn meet(&self, node_host: &str, ports: [u16; 2]) -> Result<Vec<SocketAddrV4>, TrainError> {
        const WIDTH: usize = 6;
        let (rank, nodes) = (self.spec.rank, self.spec.nodes);
        let ip = (node_host, ports[0])
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| {
                a.find_map(|a| match a.ip() {
                    std::net::IpAddr::V4(v4) => Some(v4),
                    std::net::IpAddr::V6(_) => None,
                })
            })
            .unwrap_or(Ipv4Addr::LOCALHOST);
        let mut mine = vec![0f32; WIDTH * nodes];
        for (i, octet) in ip.octets().iter().enumerate() {
            mine[rank * WIDTH + i] = *octet as f32;
        }
        mine[rank * WIDTH + 4] = ports[0] as f32;
        mine[rank * WIDTH + 5] = ports[1] as f32;
        let all = self.all_reduce_sum(mine, "joining the run")?;
        Ok(all
            .chunks(WIDTH)
            .flat_map(|a| {
                let ip = Ipv4Addr::new(a[0] as u8, a[1] as u8, a[2] as u8, a[3] as u8);
                [
                    SocketAddrV4::new(ip, a[4] as u16),
                    SocketAddrV4::new(ip, a[5] as u16),
                ]
            })
            .collect())
    }

    /// This node's rank.
    pub fn rank(&self) -> usize {
        self.spec.rank
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.spec.nodes
    }

    /// The element-wise sum of `values` over every node (each node passes
    /// a vector of the same length). `what` names the step in errors.
    ///
    /// One session of the engine: register, wait until every node's tensor
    /// service of this session listens (before the nodes have met: a grace
    /// period), sum, finish.
    pub fn all_reduce_sum(&self, values: Vec<f32>, what: &str) -> Result<Vec<f32>, TrainError> {
        let n = values.len();
        if n == 0 {
            return Ok(values);
        }
        let check = SumCheck::new(self.calls.get(), n);
        let mut values = values;
        values.extend(check.tail(&values));
        let checked = values.len();
        // The ring cuts the vector into one piece per node.
        values.resize(checked.max(self.spec.nodes), 0.0);
        let len = values.len();
        let tensor = Tensor::<Engine, 1>::from_data(TensorData::new(values, [len]), &self.device);
        let primitive = tensor.into_primitive().tensor();
        let (peer, device) = (self.peer, self.device.clone());
        let session = (self.calls.get() % 2) as usize;
        self.calls.set(self.calls.get() + 1);
        let config = self.sessions[session].clone();
        let own_port = self.own_ports[session];
        let peers: Vec<SocketAddrV4> = self
            .data_ports
            .iter()
            .skip(session)
            .step_by(2)
            .copied()
            .collect();
        if let Some(previous) = self.finishing.borrow_mut().take() {
            self.answer(&format!("ending the sum before {what}"), previous)?;
        }
        let started = Instant::now();
        let deadline = started + self.spec.timeout;
        let (finished, finishing) = mpsc::channel();
        let summed = self.within_timeout(what, move |answer| {
            await_free(own_port, deadline);
            let sum = burn_collective::register::<Engine>(peer, device, config).and_then(|()| {
                await_listening(&peers, deadline);
                burn_collective::all_reduce::<Engine>(peer, primitive, ReduceOperation::Sum)
            });
            let reduced = sum.is_ok();
            let _ = answer.send(sum);
            if reduced {
                let _ = finished.send(burn_collective::finish_collective::<Engine>(peer));
            }
        })?;
        *self.finishing.borrow_mut() = Some(finishing);
        let summed = Tensor::<Engine, 1>::from_primitive(TensorPrimitive::Float(summed));
        let mut summed = summed
            .into_data()
            .to_vec::<f32>()
            .map_err(|e| TrainError::Peer(format!("{what}: unreadable sum: {e:?}")))?;
        summed.truncate(checked);
        if crate::fault::inject(crate::fault::Point::Sum).is_err() {
            // What a stranger's vector in the ring does to the sum: here
            // one of small positive numbers (one of mixed signs may cancel
            // in the weighted checksum to within the rounding it allows).
            for v in &mut summed[..n] {
                *v += 1e-3;
            }
        }
        if !check.adds_up(&summed, self.spec.nodes) {
            return Err(TrainError::Peer(format!(
                "node {}: the sum while {what} does not add up: a process that is not a node of this \
                 run took part in it (a run's ports must be reachable only by its nodes: see \
                 docs/training.md); restart every node with --resume",
                self.spec.rank
            )));
        }
        summed.truncate(n);
        tracing::debug!(
            bytes = 4 * len,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "collective sum: {what}"
        );
        Ok(summed)
    }

    /// Runs blocking calls of the engine on a thread of their own, which
    /// sends their answer as soon as it has it (and may go on), and waits
    /// for the answer at most the timeout. On a timeout the calls are
    /// abandoned (their thread stays blocked until the process exits,
    /// which the error leads to).
    fn within_timeout<T: Send + 'static>(
        &self,
        what: &str,
        call: impl FnOnce(mpsc::Sender<EngineResult<T>>) + Send + 'static,
    ) -> Result<T, TrainError> {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(ENGINE_THREAD.into())
            .spawn(move || call(tx))
            .map_err(|e| TrainError::Peer(format!("cannot start a collective call: {e}")))?;
        self.answer(what, rx)
    }

    /// The engine's answer on `rx`, waited for at most the timeout.
    fn answer<T>(&self, what: &str, rx: mpsc::Receiver<EngineResult<T>>) -> Result<T, TrainError> {
        let s = &self.spec;
        let others = other_nodes(s.nodes, s.rank);
        let fail = |what_happened: String| {
            TrainError::Peer(format!(
                "node {}: {what_happened} (restart every node with --resume to continue from the last checkpoint)",
                s.rank
            ))
        };
        match rx.recv_timeout(s.timeout) {
            Ok(Ok(v)) => Ok(v),
            // The engine's own error when a peer's connection drops before
            // the call (its data server gone): name who may be gone.
            Ok(Err(e)) => Err(fail(format!(
                "the collective failed while {what} ({e:?}): {others} died, stopped or cannot be reached"
            ))),
            Err(RecvTimeoutError::Timeout) => Err(fail(format!(
                "no answer from {others} within {} s while {what}: it died, hangs, never started or cannot be reached",
                s.timeout.as_secs_f64()
            ))),
            // The engine panics when a peer's connection drops.
            Err(RecvTimeoutError::Disconnected) => Err(fail(format!(
                "lost the connection to {others} while {what}: it died or stopped"
            ))),
        }
    }
}

/// What every node adds to a vector it sums, so that a sum that is not
/// the nodes' own is refused rather than stepped with.
///
/// The engine has no authentication: a process that registers with the
/// coordinator at the right moment takes part in a session and its vector
/// enters the sum. The tail catches that: each node appends `[1, f, c, a]`
/// with `f` = 1 if its vector holds a non-finite number, `c = sum_j w_j v_j`
/// and `a = sum_j w_j |v_j|` for pseudo-random weights `w_j` in [0.5, 1.5)
/// drawn afresh for every call. In an honest sum the first entry is the
/// number of nodes, exactly, and `c` is `sum_j w_j S_j` of the summed
/// vector `S` to within `f32` rounding (bounded by `a`). A vector from
/// elsewhere breaks one or the other, unless made for it by someone who
/// knows this scheme: a check against accidents and strangers, not an
/// authentication (docs/training.md: trusted networks only).
struct SumCheck {
    /// Seeds the weights (the call's index: every node draws the same).
    seed: u64,
    /// Length of the vector checked.
    len: usize,
}

impl SumCheck {
    const TAIL: usize = 4;

    fn new(call: u64, len: usize) -> Self {
        Self { seed: call, len }
    }

    /// The weight of entry `j`, in [0.5, 1.5).
    fn weight(&self, j: usize) -> f64 {
        // splitmix64 of (seed, j).
        let mut z = (self.seed << 40 ^ j as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        0.5 + (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// (`c`, `a`) of `values`.
    fn sums(&self, values: &[f32]) -> (f64, f64) {
        values
            .iter()
            .enumerate()
            .fold((0.0, 0.0), |(c, a), (j, &v)| {
                let w = self.weight(j);
                (c + w * v as f64, a + w * (v as f64).abs())
            })
    }

    /// This node's tail for `values` (the vector to sum, `len` long).
    fn tail(&self, values: &[f32]) -> [f32; Self::TAIL] {
        let finite = values.iter().all(|v| v.is_finite());
        let (c, a) = self.sums(values);
        [1.0, if finite { 0.0 } else { 1.0 }, c as f32, a as f32]
    }

    /// Whether `summed` (the vector and the tails, summed) is the sum of
    /// `nodes` nodes' own vectors.
    fn adds_up(&self, summed: &[f32], nodes: usize) -> bool {
        let (values, tail) = summed.split_at(self.len);
        let [count, non_finite, c, a] = [tail[0], tail[1], tail[2], tail[3]];
        if count != nodes as f32 {
            return false;
        }
        let finite = values.iter().all(|v| v.is_finite());
        if !finite || !c.is_finite() || !a.is_finite() {
            // A node's own non-finite numbers pass (the step reports a
            // non-finite loss and stops); anyone else's do not.
            return non_finite >= 1.0 && non_finite <= nodes as f32;
        }
        let (expected, _) = self.sums(values);
        // Each sum of `nodes` f32 numbers and each node's f32 tail are off
        // by at most a few `nodes x eps x a`; 100x that is still far below
        // what a foreign vector moves `c` by.
        non_finite == 0.0
            && (c as f64 - expected).abs() <= 100.0 * nodes as f64 * f32::EPSILON as f64 * a as f64
    }
}

/// Name of the threads that wait in the collective engine (a panic there
/// is the engine's, reported by [`Collective`] as an error).
pub const ENGINE_THREAD: &str = "tvq-collective";

/// Waits until every node's tensor service of this session accepts
/// connections (until `deadline`). The engine starts a node's service when
/// it registers but does not wait for it, and a peer that connects too
/// early fails the whole reduction (the engine does not retry). With no
/// addresses known yet, waits a grace period.
fn await_listening(peers: &[SocketAddrV4], deadline: Instant) {
    if peers.is_empty() {
        std::thread::sleep(Duration::from_millis(250));
    }
    for peer in peers {
        while TcpStream::connect_timeout(&(*peer).into(), Duration::from_secs(1)).is_err()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Waits until `port` can be bound (until `deadline`): the engine's
/// service of the session before last may still be shutting down there,
/// and the new one would then fail to start, silently.
fn await_free(port: u16, deadline: Instant) {
    while TcpListener::bind(("0.0.0.0", port)).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Prefix of the names of the coordinator's threads (its connections are
/// served there too, so a panic there is the engine's).
pub const COORDINATOR_THREAD: &str = "tvq-coordinator-";

/// Serves burn-collective's coordinator (orchestrator) on `port`, on a
/// thread of its own until the process ends.
fn start_coordinator(port: u16) -> Result<(), TrainError> {
    std::thread::Builder::new()
        .name(format!("{COORDINATOR_THREAD}{port}"))
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(burn_collective::start_global_orchestrator(port)),
                Err(e) => tracing::error!("cannot start the coordinator: {e}"),
            }
        })
        .map(drop)
        .map_err(|e| TrainError::Peer(format!("cannot start the coordinator thread: {e}")))
}

/// Runs `start` (which starts the coordinators), then gives SIGINT and
/// SIGTERM back the handlers they had before. The coordinator installs its
/// own, to shut down on Ctrl-C; it would then be gone before the nodes,
/// which stop after the step that carries the interrupt, could gather
/// their states for the last checkpoint. Waits (at most 2 s) for the
/// coordinator to install them, so as to undo it.
#[cfg(unix)]
fn keeping_signal_handlers<T>(start: impl FnOnce() -> T) -> T {
    const SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];
    // SAFETY: `sigaction` reads into and restores from plain structs owned
    // here; a zeroed `sigaction` is a valid value to be written into.
    let current = |sig| unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut action);
        action
    };
    let before = SIGNALS.map(current);
    let out = start();
    let deadline = Instant::now() + Duration::from_secs(2);
    while SIGNALS
        .iter()
        .zip(&before)
        .any(|(&sig, b)| current(sig).sa_sigaction == b.sa_sigaction)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(1));
    }
    for (sig, action) in SIGNALS.iter().zip(&before) {
        // SAFETY: restores an action read above.
        unsafe { libc::sigaction(*sig, action, std::ptr::null_mut()) };
    }
    out
}

#[cfg(not(unix))]
fn keeping_signal_handlers<T>(start: impl FnOnce() -> T) -> T {
    start()
}

/// "node 1" or "node 0, 2 or 3": who a node waits for.
fn other_nodes(nodes: usize, rank: usize) -> String {
    let others: Vec<String> = (0..nodes)
        .filter(|&r| r != rank)
        .map(|r| r.to_string())
        .collect();
    match others.as_slice() {
        [one] => format!("node {one}"),
        [init @ .., last] => format!("node {} or {last}", init.join(", ")),
        [] => "no other node".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(nodes: usize, rank: usize, coordinator: &str) -> ClusterSpec {
        ClusterSpec {
            nodes,
            rank,
            coordinator: coordinator.into(),
            host: None,
            data_port: None,
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn bad_specs_are_refused_before_the_network() {
        let err = |s: ClusterSpec| s.validate().unwrap_err().to_string();
        assert!(err(spec(2, 2, "127.0.0.1:5000")).contains("--node-rank"));
        assert!(err(spec(1, 0, "127.0.0.1:5000")).contains("--nodes"));
        assert!(err(spec(2, 0, "127.0.0.1")).contains("HOST:PORT"));
        assert!(err(spec(2, 0, ":5000")).contains("HOST:PORT"));
        assert_eq!(
            spec(2, 1, "host:5000").validate().unwrap(),
            ("host".into(), 5000)
        );
        assert_eq!(spec(2, 1, "host:5000").data_port(5000).unwrap(), 5004);
    }

    #[test]
    fn a_port_in_use_is_named() {
        let taken = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = check_port_free(port, "the coordinator", "--coordinator").unwrap_err();
        assert!(e.to_string().contains(&format!("port {port}")), "{e}");
    }

    /// Sums of `vectors` (each with its node's tail) as the engine would.
    fn summed(check: &SumCheck, vectors: &[Vec<f32>]) -> Vec<f32> {
        let mut sum = vec![0f32; check.len + SumCheck::TAIL];
        for v in vectors {
            let tailed: Vec<f32> = v.iter().copied().chain(check.tail(v)).collect();
            for (s, x) in sum.iter_mut().zip(tailed) {
                *s += x;
            }
        }
        sum
    }

    #[test]
    fn a_sum_with_a_foreign_or_missing_vector_does_not_add_up() {
        let n = 10_000;
        let check = SumCheck::new(7, n);
        let node = |k: f32| -> Vec<f32> { (0..n).map(|j| (j as f32 * k).sin() * 1e-3).collect() };
        let (a, b) = (node(0.37), node(1.91));
        assert!(check.adds_up(&summed(&check, &[a.clone(), b.clone()]), 2));
        // One node's vector missing, or a third one in the ring.
        assert!(!check.adds_up(&summed(&check, std::slice::from_ref(&a)), 2));
        assert!(!check.adds_up(&summed(&check, &[a.clone(), b.clone(), node(3.3)]), 2));
        // A stranger in a node's place, even one that copies the count.
        let mut honest = summed(&check, &[a.clone(), b.clone()]);
        for (s, x) in honest.iter_mut().zip(node(5.1).iter().chain(&[0.0; 4])) {
            *s += x;
        }
        assert!(!check.adds_up(&honest, 2));
        let mut one_entry = summed(&check, &[a.clone(), b.clone()]);
        one_entry[n / 2] += 1e-3;
        assert!(!check.adds_up(&one_entry, 2));
        // Non-finite numbers: a node's own pass (the step stops on them),
        // a stranger's do not.
        let mut diverged = b.clone();
        diverged[3] = f32::NAN;
        assert!(check.adds_up(&summed(&check, &[a.clone(), diverged]), 2));
        let mut poisoned = summed(&check, &[a, b]);
        poisoned[3] = f32::NAN;
        assert!(!check.adds_up(&poisoned, 2));
        // Every call draws other weights.
        assert_ne!(check.weight(3), SumCheck::new(8, n).weight(3));
    }

    #[test]
    fn errors_name_the_nodes_waited_for() {
        assert_eq!(other_nodes(2, 0), "node 1");
        assert_eq!(other_nodes(4, 2), "node 0, 1 or 3");
    }
}
