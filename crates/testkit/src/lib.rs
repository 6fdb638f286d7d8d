//! Test support shared by the tests of tvq's crates, and by nothing else
//! (a dev-dependency only): which GPU the backend tests compare with the
//! CPU and what a test does when it is missing, the tiny model of the unit
//! tests, waiting on a child process, the directory of the crate under
//! test, and a heap allocator that counts.
//!
//! It knows nothing of how a device is probed: each crate probes with its
//! own code (a second copy of the probes in one test binary would set up a
//! GPU runtime twice), and asks here what the answer means.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tvq_model::TransformerVqConfig;

/// The GPU that the backend tests compare with the CPU: CUDA's when
/// `TVQ_TEST_DEVICE=cuda`, else wgpu's default
/// adapter (Mesa's lavapipe in CI).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gpu {
    /// wgpu's default adapter.
    Wgpu,
    /// CUDA device 0.
    Cuda,
}

impl Gpu {
    /// The GPU named by `TVQ_TEST_DEVICE`.
    pub fn under_test() -> Self {
        match std::env::var("TVQ_TEST_DEVICE").as_deref() {
            Ok("cuda") => Self::Cuda,
            _ => Self::Wgpu,
        }
    }

    /// Its name as `tvq --device` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Wgpu => "wgpu",
            Self::Cuda => "cuda",
        }
    }

    /// Whether a test fails, rather than skips, without it: CUDA when it
    /// was named; wgpu when `TVQ_REQUIRE_WGPU` is set (CI installs a
    /// software Vulkan driver and sets it, so there the tests run for
    /// real).
    pub fn required(self) -> bool {
        self == Self::Cuda || std::env::var_os("TVQ_REQUIRE_WGPU").is_some()
    }

    /// The verdict on `test` when the GPU is missing for reason `why`:
    /// `Ok(line)` to print and skip, `Err(message)` to fail with.
    pub fn verdict(self, required: bool, test: &str, why: &str) -> Result<String, String> {
        let name = self.name();
        if required {
            Err(format!(
                "{test}: no {name} GPU ({why}), and it is required \
                 (TVQ_TEST_DEVICE=cuda, or TVQ_REQUIRE_WGPU)"
            ))
        } else {
            Ok(format!(
                "SKIPPED {test}: no {name} GPU ({why}; for wgpu install a Vulkan driver, \
                 e.g. Debian's mesa-vulkan-drivers; TVQ_REQUIRE_WGPU=1 makes this a failure)"
            ))
        }
    }

    /// `test` found no GPU (`why`): panics where the GPU is
    /// [`required`](Self::required), else prints a visible SKIPPED line and
    /// returns, and the caller returns too.
    pub fn missing(self, test: &str, why: &str) {
        match self.verdict(self.required(), test, why) {
            // Straight to stderr: libtest hides `eprintln!` of a passing test.
            Ok(skipped) => drop(writeln!(std::io::stderr(), "{skipped}")),
            Err(failure) => panic!("{failure}"),
        }
    }
}

/// The tiny model of the unit tests: blocks of 4, 2 heads, one layer (two
/// sublayers), 5 codes, `d_model` 16; a test that needs another shape says
/// so with the config's `with_*` setters.
pub fn tiny_model(vocab_size: usize) -> TransformerVqConfig {
    TransformerVqConfig::new(vocab_size)
        .with_d_model(16)
        .with_d_k(8)
        .with_d_v(12)
        .with_n_code(5)
        .with_n_head(2)
        .with_n_layer(1)
        .with_block_len(4)
}

/// Polls `done` until it holds, failing at once (with the child's stderr
/// when it was piped) if `child` exits first, or after five minutes: a
/// condition that may hold only briefly (a checkpoint the next step
/// prunes) must not be waited for.
pub fn wait_for(child: &mut Child, what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut stderr) = child.stderr.take() {
                std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
            }
            panic!("the process exited ({status}) before {what}:\n{err}");
        }
        assert!(start.elapsed() < Duration::from_secs(300), "no {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The directory of the crate under test, read when the test runs (cargo
/// sets `CARGO_MANIFEST_DIR` for it): a test binary reused from a build of
/// another checkout into the same target directory would otherwise read
/// that checkout's files, or fail where it no longer exists.
pub fn crate_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("tests run by cargo"))
}

/// The Python that imports every one of `modules`, as an absolute path (so
/// that a child given another PATH still finds it, and its directory can
/// lead that PATH): `TVQ_PYTHON`, else the `python3` of the PATH (an
/// activated virtual or conda environment's). `None`, after a SKIPPED
/// line, where it lacks one; a failure instead under `TVQ_REQUIRE_TORCH`
/// (CI installs PyTorch and sets it, so there these tests run for real).
pub fn python_with(test: &str, modules: &[&str]) -> Option<PathBuf> {
    let python = std::env::var_os("TVQ_PYTHON").map_or("python3".into(), PathBuf::from);
    let executable = Command::new(&python)
        .args([
            "-c",
            &format!("import sys, {}; print(sys.executable)", modules.join(", ")),
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(executable) = executable.filter(|e| e.is_absolute()) {
        return Some(executable);
    }
    let why = format!(
        "{} lacks one of {modules:?} (pip install {})",
        python.display(),
        modules.join(" ")
    );
    assert!(
        std::env::var_os("TVQ_REQUIRE_TORCH").is_none(),
        "{test}: {why}, and TVQ_REQUIRE_TORCH is set"
    );
    // Straight to stderr: the harness hides a passing test's eprintln!.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
    None
}

/// The largest `|a - b|` over the pairs (0 where they are equal, infinities
/// included), NaN where any difference is NaN: `f32::max` skips a NaN, so
/// a fold of it would let a NaN pass any tolerance.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).fold(0.0, |worst: f32, (x, y)| {
        let d = if x == y { 0.0 } else { (x - y).abs() };
        if d.is_nan() || worst.is_nan() {
            f32::NAN
        } else {
            worst.max(d)
        }
    })
}

/// The system allocator, counting the bytes held now and the most held: a
/// test binary that installs it (`#[global_allocator] static A:
/// CountingAllocator = CountingAllocator;`) measures its own heap, which
/// is where the CPU backend keeps its tensors. Counts are process-wide, so
/// such a binary measures one thing at a time.
pub struct CountingAllocator;

static HELD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl CountingAllocator {
    /// Bytes held now.
    pub fn held() -> usize {
        HELD.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The most bytes held since the last [`Self::reset_peak`].
    pub fn peak() -> usize {
        PEAK.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Starts a new peak from what is held now; returns that.
    pub fn reset_peak() -> usize {
        let held = Self::held();
        PEAK.store(held, std::sync::atomic::Ordering::SeqCst);
        held
    }
}

// SAFETY: every call goes to the system allocator unchanged; only counters
// are added.
unsafe impl std::alloc::GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use std::sync::atomic::Ordering::SeqCst;
        // SAFETY: the caller's contract is passed on.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            let held = HELD.fetch_add(layout.size(), SeqCst) + layout.size();
            PEAK.fetch_max(held, SeqCst);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's contract is passed on.
        unsafe { std::alloc::System.dealloc(ptr, layout) };
        HELD.fetch_sub(layout.size(), std::sync::atomic::Ordering::SeqCst);
    }
}

/// The system allocator with each new byte set to `0xFF` first (every
/// `f32` a NaN, every integer -1), where the system's fresh pages would be
/// zeros: a kernel that returns an element it never wrote then shows it.
/// Zeroed allocations stay zeroed; a reallocation poisons what it adds.
pub struct PoisonedAllocator;

/// The byte every new allocation is filled with.
const POISON: u8 = 0xFF;

// SAFETY: every call goes to the system allocator unchanged; only bytes
// the caller owns and has not initialised are written.
unsafe impl std::alloc::GlobalAlloc for PoisonedAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            // SAFETY: `p` holds `layout.size()` bytes, all the caller's.
            unsafe { std::ptr::write_bytes(p, POISON, layout.size()) };
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: the caller's contract is passed on.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new_size) };
        if !p.is_null() && new_size > layout.size() {
            // SAFETY: bytes `layout.size()..new_size` of `p` are new.
            unsafe {
                std::ptr::write_bytes(p.add(layout.size()), POISON, new_size - layout.size())
            };
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_anywhere_makes_the_difference_nan() {
        assert_eq!(max_abs_diff(&[1.0, -2.0], &[1.5, 1.0]), 3.0);
        assert!(max_abs_diff(&[f32::NAN, 1.0], &[0.0, 5.0]).is_nan());
        assert!(max_abs_diff(&[1.0, f32::NAN], &[9.0, 0.0]).is_nan());
        assert_eq!(
            max_abs_diff(&[f32::NEG_INFINITY], &[f32::NEG_INFINITY]),
            0.0
        );
        assert_eq!(max_abs_diff(&[f32::INFINITY], &[1.0]), f32::INFINITY);
    }

    #[test]
    fn the_poisoned_allocator_fills_only_new_bytes() {
        use std::alloc::{GlobalAlloc, Layout};
        let (a, layout) = (PoisonedAllocator, Layout::from_size_align(64, 8).unwrap());
        // SAFETY: each pointer is checked non-null, read within its size,
        // and freed with the layout it has.
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null());
            let bytes = std::slice::from_raw_parts(p, 64);
            assert!(bytes.iter().all(|&b| b == POISON));
            assert!(f32::from_ne_bytes([POISON; 4]).is_nan());
            p.write_bytes(7, 64);
            let p = a.realloc(p, layout, 4096);
            assert!(!p.is_null());
            let bytes = std::slice::from_raw_parts(p, 4096);
            assert!(bytes[..64].iter().all(|&b| b == 7), "kept");
            assert!(bytes[64..].iter().all(|&b| b == POISON), "poisoned");
            a.dealloc(p, Layout::from_size_align(4096, 8).unwrap());
            let z = a.alloc_zeroed(layout);
            assert!(!z.is_null());
            assert!(std::slice::from_raw_parts(z, 64).iter().all(|&b| b == 0));
            a.dealloc(z, layout);
        }
    }

    #[test]
    fn a_missing_gpu_skips_unless_required() {
        let skipped = Gpu::Wgpu.verdict(false, "t", "no adapter").unwrap();
        assert!(skipped.starts_with("SKIPPED t:") && skipped.contains("no adapter"));
        let failure = Gpu::Wgpu.verdict(true, "t", "no adapter").unwrap_err();
        assert!(failure.contains("no adapter") && failure.contains("required"));
        assert!(Gpu::Cuda.required(), "a named CUDA GPU is always required");
    }
}
