//! Running the independent shards of a batch on worker threads.
//!
//! The CPU backend runs matrix products on every core but elementwise ops
//! (silu gates, softmax `exp`, copies) on the calling thread only, so one
//! forward/backward pass keeps about 1.2 of 2 cores busy. Rows of a batch
//! are independent streams, so shards of rows can run at once. Results come
//! back in shard order whatever the threads' timing. Workers may also be
//! spread over several devices of one backend (`check_device_list`).
//!
//! Worker threads live for one call, but each worker index keeps one GPU
//! stream over the whole run ([`worker_stream`]): burn's GPU runtimes give
//! every new thread a stream of its own, with a memory pool of its own that
//! keeps what it reserved, so fresh threads each step grew a wgpu run with
//! two workers by 137 MiB a step (the quick start, on lavapipe).

use std::sync::{Mutex, OnceLock};

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
    let mut done: Vec<(usize, Result<R, E>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(w, queue)| {
                scope.spawn(move || {
                    worker_stream(w).executes(|| {
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

/// The GPU stream of worker `w` (of any call to [`map_in_workers`]): the
/// same in every call, and no other thread's. A thread takes its stream
/// the first time it asks, so a new worker index's comes from a thread
/// started just to ask (and which does nothing else).
pub(crate) fn worker_stream(w: usize) -> StreamId {
    static STREAMS: OnceLock<Mutex<Vec<StreamId>>> = OnceLock::new();
    let mut streams = STREAMS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    while streams.len() <= w {
        let fresh = std::thread::spawn(StreamId::current)
            .join()
            .expect("asking for a stream id does not panic");
        streams.push(fresh);
    }
    streams[w]
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
    use super::map_in_workers;
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

    /// Each worker computes on the same GPU stream in every call, on none
    /// that another worker or the caller uses: a new stream per call would
    /// give each step's threads new memory pools (see the module's note).
    #[test]
    fn each_worker_keeps_its_gpu_stream_from_call_to_call() {
        let streams = || {
            map_in_workers(
                (0..4).collect(),
                2,
                |_| StreamId::current(),
                |ctx, _: u32| Ok::<_, ()>(*ctx),
            )
            .unwrap()
        };
        let (first, second) = (streams(), streams());
        assert_eq!(first, second);
        assert_eq!((first[0], first[1]), (first[2], first[3]));
        assert_ne!(first[0], first[1]);
        assert!(!first.contains(&StreamId::current()));
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
