//! Progress bars on the terminal (indicatif), hidden when asked.

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar of `len` units drawn with indicatif's `template` (which
/// places `{bar:30}`), or a hidden one when `show` is false.
pub(crate) fn progress_bar(show: bool, len: u64, template: &str) -> ProgressBar {
    let bar = if show {
        ProgressBar::new(len)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(style(template));
    bar
}

/// tvq's progress style with indicatif's `template`.
pub(crate) fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .expect("valid template")
        .progress_chars("=> ")
}
