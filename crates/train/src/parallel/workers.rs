//! Running the independent shards of a batch on worker threads.
//!
//! The CPU backend runs matrix products on every core but elementwise ops
//! (silu gates, softmax `exp`, copies) on the calling thread only, so one
//! forward/backward pass keeps about 1.2 of 2 cores busy. Rows of a batch
//! are independent streams, so shards of rows can run at once. Results come
//! back in shard order whatever the threads' timing. Workers may also be
//! spread over several devices of one backend (`check_device_list`).
//!
//! Workers are the threads of a crew (`Crew`) that lives as long as the
//! process and is a rayon pool of its own, for two reasons:
//! - The CPU backend splits its matrix products over the rayon pool of
//!   the thread that calls them. On plain threads a worker handed them to
//!   the global pool and slept until they were done, while both cores
//!   also ran the other worker: a step kept about 1.75 of 2 cores busy. In
//!   its own crew a worker computes its own products and takes up the
//!   other worker's chunks when it waits (about 1.9 cores; the speed A/B
//!   is in docs/benchmarks.md, "Worker threads").
//! - burn's GPU runtimes give every thread a stream of its own, with a
//!   memory pool of its own that keeps what it reserved: fresh threads
//!   each step grew a wgpu run with two workers by 137 MiB a step (the
//!   quick start, on lavapipe). A crew's threads, and so its streams, stay.
//!
//! Each thread of a crew runs exactly one worker (a rayon broadcast, not
//! spawned tasks): a thread that waits inside a parallel op may run
//! another task of its pool meanwhile, and were that another worker, it
//! could wait on a lock its own thread holds (the dropout draw's). So the
//! only tasks a waiting worker takes up are chunks of its crew mates'
//! products, and calls at the same time get crews of their own.
//!
//! A crew belongs to the thread that called for it, for as long as that
//! thread lives: a trainer's carried states live in its workers' streams'
//! memory pools, and a GPU runtime (cubecl 0.10) reuses a freed buffer of
//! a stream's pool for that stream's next allocation even while another
//! stream's reads of it are still queued. Two trainers on two threads that
//! traded crews between steps therefore computed wrong numbers (NaN, on
//! wgpu) where either alone computed the right ones; see
//! `trainers_on_several_threads_compute_what_each_computes_alone`.

use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::placement::device::device_name;
use burn::DispatchDevice;
use burn::tensor::StreamId;

use crate::error::TrainError;

/// Maps `f` over `items` on `workers` threads and returns the results in
/// item order. Worker `w` calls `setup(w)` once, then takes items `w`,
/// `w + workers`, ... in order; with one worker everything runs on the
/// calling thread. The first error (in item order) is returned.
pub fn map_in_workers<T, C, R, E>(
    items: Vec<T>,
    workers: usize,
    setup: impl Fn(usize) -> C + Sync,
    f: impl Fn(&C, T) -> Result<R, E> + Sync,
) -> Result<Vec<R>, E>
where
    T: Send,
    R: Send,
    E: Send,
{
    let n = items.len();
    let workers = workers.clamp(1, n.max(1));
    if workers == 1 {
        let ctx = setup(0);
        return items.into_iter().map(|item| f(&ctx, item)).collect();
    }
    let mut queues: Vec<Vec<(usize, T)>> = (0..workers).map(|_| vec![]).collect();
    for (i, item) in items.into_iter().enumerate() {
        queues[i % workers].push((i, item));
    }
    let queues: Vec<Mutex<Vec<(usize, T)>>> = queues.into_iter().map(Mutex::new).collect();
    let mut done: Vec<(usize, Result<R, E>)> = CREWS
        .lease(workers)
        .run(|w| {
            let queue = std::mem::take(&mut *lock(&queues[w]));
            let ctx = setup(w);
            queue
                .into_iter()
                .map(|(i, item)| (i, f(&ctx, item)))
                .collect::<Vec<_>>()
        })
        .into_iter()
        .flatten()
        .collect();
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// `mutex` locked, whether or not a thread panicked while holding it.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The crews of every worker call ([`map_in_workers`], prefill's pipeline).
pub(crate) static CREWS: Crews = Crews::new();

/// Worker threads: a rayon pool of `n` threads, and the GPU stream each of
/// them computes on.
pub(crate) struct Crew {
    threads: rayon::ThreadPool,
    streams: Vec<StreamId>,
}

impl Crew {
    fn new(n: usize) -> Self {
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("tvq-worker-{i}"))
            .build()
            .expect("the OS starts the worker threads");
        let streams = threads.broadcast(|_| StreamId::current());
        Self { threads, streams }
    }

    /// Runs `f(0)`, ..., `f(n - 1)` at once, each on its own thread of the
    /// crew (the module's note), and returns their results in that order.
    /// A panic in any of them is resumed here once all have finished.
    pub(crate) fn run<R: Send>(&self, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        self.threads.broadcast(|thread| f(thread.index()))
    }
}

/// Crews lent to calls: a call of `n` workers gets the crew of `n` that
/// its thread was last lent, else one whose thread has ended, else a new
/// one. So a thread's calls run on the same threads and streams, calls at
/// the same time on crews of their own, and no thread ever gets a crew
/// whose last caller lives on (the module's note).
pub(crate) struct Crews {
    idle: Mutex<Vec<(Crew, Caller)>>,
}

/// Who was lent a crew last: alive while its thread is.
type Caller = Weak<()>;

thread_local! {
    /// This thread's token; crews lent to it keep a [`Weak`] to it.
    static CALLER: Arc<()> = Arc::new(());
}

/// A [`Crew`] lent by [`Crews`], given back when dropped.
pub(crate) struct CrewLease<'a> {
    crews: &'a Crews,
    crew: Option<Crew>,
    caller: Caller,
}

impl Crews {
    const fn new() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Lends a crew of `n` threads to the calling thread.
    pub(crate) fn lease(&self, n: usize) -> CrewLease<'_> {
        let caller = CALLER.with(Arc::downgrade);
        let mut idle = lock(&self.idle);
        let fits = |c: &Crew| c.streams.len() == n;
        let mine = idle
            .iter()
            .rposition(|(c, last)| fits(c) && last.ptr_eq(&caller));
        let orphan = || {
            idle.iter()
                .rposition(|(c, last)| fits(c) && last.strong_count() == 0)
        };
        let crew = match mine.or_else(orphan) {
            Some(i) => idle.remove(i).0,
            None => {
                drop(idle);
                Crew::new(n)
            }
        };
        CrewLease {
            crews: self,
            crew: Some(crew),
            caller,
        }
    }

    /// The streams of the crews not lent now.
    pub(crate) fn idle_streams(&self) -> Vec<StreamId> {
        lock(&self.idle)
            .iter()
            .flat_map(|(c, _)| c.streams.iter().copied())
            .collect()
    }
}

impl std::ops::Deref for CrewLease<'_> {
    type Target = Crew;
    fn deref(&self) -> &Crew {
        self.crew
            .as_ref()
            .expect("a lease holds its crew until dropped")
    }
}

impl Drop for CrewLease<'_> {
    fn drop(&mut self) {
        if let Some(crew) = self.crew.take() {
            let caller = std::mem::take(&mut self.caller);
            lock(&self.crews.idle).push((crew, caller));
        }
    }
}

/// Checks a `--device` list: at least one, none twice, all of one backend
/// (rows are shared out equally, so a CPU next to a GPU would make the GPU
/// wait; and the mix is not tested).
pub(crate) fn check_device_list(devices: &[DispatchDevice]) -> Result<(), TrainError> {
    let Some(first) = devices.first() else {
        return Err(TrainError::Devices("names no device".into()));
    };
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].contains(d) {
            return Err(TrainError::Devices(format!(
                "names {} twice",
                device_name(d)
            )));
        }
        if std::mem::discriminant(d) != std::mem::discriminant(first) {
            return Err(TrainError::Devices(format!(
                "mixes backends ({} and {}): list devices of one kind, e.g. cuda:0,cuda:1",
                device_name(first),
                device_name(d)
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{CREWS, Crews, map_in_workers};
    use burn::tensor::StreamId;

    #[test]
    fn results_come_back_in_item_order_from_every_worker() {
        for workers in [1, 2, 3, 8] {
            let out = map_in_workers(
                (0..10).collect(),
                workers,
                |_| std::thread::current().id(),
                |_, i: u32| Ok::<_, ()>(i * i),
            )
            .unwrap();
            assert_eq!(out, (0..10).map(|i| i * i).collect::<Vec<_>>());
        }
    }

    #[test]
    fn several_workers_run_on_their_own_threads() {
        let threads = map_in_workers(
            (0..4).collect(),
            2,
            |w| (w, std::thread::current().id()),
            |ctx, _: u32| Ok::<_, ()>(*ctx),
        )
        .unwrap();
        // Worker `w` took items `w` and `w + 2`, on a thread of its own.
        assert_eq!((threads[0].0, threads[1].0), (0, 1));
        assert_eq!(threads[0], threads[2]);
        assert_eq!(threads[1], threads[3]);
        assert_ne!(threads[0].1, threads[1].1);
        assert_ne!(threads[0].1, std::thread::current().id());
    }

    /// Workers compute on GPU streams of their own, not the caller's, and
    /// give them back when the call returns.
    #[test]
    fn workers_compute_on_lent_gpu_streams() {
        let streams = map_in_workers(
            (0..4).collect(),
            2,
            |_| StreamId::current(),
            |ctx, _: u32| Ok::<_, ()>(*ctx),
        )
        .unwrap();
        assert_eq!((streams[0], streams[1]), (streams[2], streams[3]));
        assert_ne!(streams[0], streams[1]);
        assert!(!streams.contains(&StreamId::current()));
        let idle = CREWS.idle_streams();
        assert!(idle.contains(&streams[0]) && idle.contains(&streams[1]));
    }

    /// A worker's parallel ops (the CPU backend's matrix products) run on
    /// its own crew, whose threads are the workers, not on the global pool
    /// that a plain thread would hand them to.
    #[test]
    fn workers_split_their_parallel_ops_over_their_own_crew() {
        let seen = map_in_workers(
            (0..3).collect(),
            3,
            |_| (),
            |_, _: u32| {
                let (a, b) = rayon::join(
                    || (rayon::current_num_threads(), rayon::current_thread_index()),
                    || std::thread::current().name().map(str::to_owned),
                );
                Ok::<_, ()>((a, b))
            },
        )
        .unwrap();
        for ((threads, index), name) in seen {
            assert_eq!(threads, 3);
            assert!(index.is_some());
            assert!(name.is_some_and(|n| n.starts_with("tvq-worker-")));
        }
    }

    /// Crews: the same threads and streams again for calls one after the
    /// other, others for calls at the same time (a new stream per call
    /// would give each step's threads new memory pools: the module's note).
    #[test]
    fn crews_are_lent_again_and_never_twice_at_once() {
        let crews = Crews::new();
        let first = crews.lease(2).streams.clone();
        assert_ne!(first[0], first[1]);
        let again = crews.lease(2);
        assert_eq!(again.streams, first);
        let meanwhile = crews.lease(2);
        assert!(meanwhile.streams.iter().all(|s| !first.contains(s)));
        drop(meanwhile);
        drop(again);
        assert_eq!(crews.idle_streams().len(), 4);
        assert_eq!(crews.lease(2).streams, first, "the last given back");
    }

    /// A crew is lent only to the thread it was last lent to while that
    /// thread lives, and to any thread once it has ended.
    #[test]
    fn a_crew_stays_with_its_thread_while_the_thread_lives() {
        let crews = Crews::new();
        let mine = crews.lease(2).streams.clone();
        let streams_on_a_thread =
            || std::thread::scope(|s| s.spawn(|| crews.lease(2).streams.clone()).join().unwrap());
        let other = streams_on_a_thread();
        assert!(
            other.iter().all(|s| !mine.contains(s)),
            "mine is idle but not its"
        );
        assert_eq!(
            streams_on_a_thread(),
            other,
            "an ended thread's crew is taken up"
        );
        assert_eq!(crews.lease(2).streams, mine);
        assert_eq!(crews.idle_streams().len(), 4, "two crews in all");
    }

    #[test]
    fn the_first_error_in_item_order_wins() {
        let out = map_in_workers(
            (0..6).collect(),
            3,
            |_| (),
            |_, i: u32| if i >= 2 { Err(i) } else { Ok(i) },
        );
        assert_eq!(out, Err(2));
    }
}
