//! Running the independent shards of a batch on worker threads.
//!
//! The CPU backend runs matrix products on every core but elementwise ops
//! (silu gates, softmax `exp`, copies) on the calling thread only, so one
//! forward/backward pass keeps about 1.2 of 2 cores busy. Rows of a batch
//! are independent streams, so shards of rows can run at once. Results come
//! back in shard order whatever the threads' timing. Workers may also be
//! spread over several devices of one backend (`check_device_list`).
//!
//! Worker threads live for one call, but their GPU streams outlive them
//! (`StreamPool`): burn's GPU runtimes give every new thread a stream of
//! its own, with a memory pool of its own that keeps what it reserved, so
//! fresh threads each step grew a wgpu run with two workers by 137 MiB a
//! step (the quick start, on lavapipe).

use std::sync::Mutex;

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
    let (setup, f) = (&setup, &f);
    let streams = WORKER_STREAMS.lease(workers);
    let mut done: Vec<(usize, Result<R, E>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = queues
            .into_iter()
            .zip(streams.iter().copied())
            .enumerate()
            .map(|(w, (queue, stream))| {
                scope.spawn(move || {
                    stream.executes(|| {
                        let ctx = setup(w);
                        queue
                            .into_iter()
                            .map(|(i, item)| (i, f(&ctx, item)))
                            .collect::<Vec<_>>()
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

/// The GPU streams of the worker threads of every [`map_in_workers`].
pub(crate) static WORKER_STREAMS: StreamPool = StreamPool::new();

/// GPU streams lent to threads: a call's `n` workers get the same `n`
/// streams as the call before (taken and given back in order), and calls
/// at the same time get streams of their own (two threads computing on one
/// stream at once mix their queued operations).
pub(crate) struct StreamPool {
    idle: Mutex<Vec<StreamId>>,
}

/// Streams lent by a [`StreamPool`], given back when dropped.
pub(crate) struct StreamLease<'a> {
    pool: &'a StreamPool,
    streams: Vec<StreamId>,
}

impl StreamPool {
    const fn new() -> Self {
        Self {
            idle: Mutex::new(Vec::new()),
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<StreamId>> {
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Lends `n` streams: the last `n` given back, or new ones. A thread
    /// takes its stream the first time it asks, so a new one comes from a
    /// thread started just to ask (which computes nothing).
    pub(crate) fn lease(&self, n: usize) -> StreamLease<'_> {
        let mut idle = self.idle();
        let keep = idle.len().saturating_sub(n);
        let mut streams = idle.split_off(keep);
        while streams.len() < n {
            let fresh = std::thread::spawn(StreamId::current)
                .join()
                .expect("asking for a stream id does not panic");
            streams.push(fresh);
        }
        StreamLease {
            pool: self,
            streams,
        }
    }

    /// The streams not lent now.
    pub(crate) fn idle_streams(&self) -> Vec<StreamId> {
        self.idle().clone()
    }
}

impl std::ops::Deref for StreamLease<'_> {
    type Target = [StreamId];
    fn deref(&self) -> &[StreamId] {
        &self.streams
    }
}

impl Drop for StreamLease<'_> {
    fn drop(&mut self) {
        self.pool.idle().append(&mut self.streams);
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
    use super::{StreamPool, WORKER_STREAMS, map_in_workers};
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
        let idle = WORKER_STREAMS.idle_streams();
        assert!(idle.contains(&streams[0]) && idle.contains(&streams[1]));
    }

    /// A pool lends the same streams, in order, to calls one after the
    /// other, and other streams to calls at the same time: a new stream per
    /// call would give each step's threads new memory pools (the module's
    /// note).
    #[test]
    fn a_stream_pool_lends_the_same_streams_again_and_never_twice_at_once() {
        let pool = StreamPool::new();
        let first = pool.lease(2).to_vec();
        assert_ne!(first[0], first[1]);
        let again = pool.lease(2);
        assert_eq!(*again, first[..]);
        let meanwhile = pool.lease(3);
        assert!(meanwhile.iter().all(|s| !first.contains(s)));
        drop(meanwhile);
        drop(again);
        assert_eq!(pool.idle_streams().len(), 5);
        assert_eq!(*pool.lease(2), first[..], "the last given back, in order");
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
