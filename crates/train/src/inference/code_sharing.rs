//! Whether a recall answer's pair shares its code in the compressed cache.
//!
//! Beyond the two-block window a key survives only as its code, and the
//! cache keeps one value per code: the sum of the values of every cached
//! key that took it. So when the pair an answer needs has left the window,
//! the answer is clean if no other pair of the example took the same code,
//! and a mixture of the pairs' values if some did. This module counts, for
//! every answer whose pair is in the cache when it is asked for, how many
//! other pairs of its example share the pair's code (per sublayer and
//! head), and tallies accuracy by that count: the cache's capacity,
//! measured example by example rather than guessed from the codebook size.
//! A pair that shares its code in one codebook may still be told apart in
//! another (each sublayer and head quantizes with its own), so a second,
//! joint tally counts the other pairs that share the pair's code in every
//! codebook at once: those no codebook of the model tells apart from it.
//!
//! Positions here are the model's: position `p` reads token `p - 1` and
//! predicts token `p`. An answer at `p` given `d` tokens back was read at
//! position `p - d + 1` (its *source*, the first position whose key can
//! carry it). Position `t` is in the cache at `p` when its block lies at
//! least two blocks before `p`'s: `t / L + 2 <= p / L`.

use serde::{Deserialize, Serialize};
use tvq_data::recall::Answer;

/// Accuracy of the cached answers whose pair shares its code with
/// `first..=last` other cached pairs of its example.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharingBucket {
    /// Fewest other pairs on the code in the bucket.
    pub first: u64,
    /// Most (`2^k - 1`; 0 for the bucket of pairs alone on their code).
    pub last: u64,
    /// Answers in the bucket.
    pub answers: u64,
    /// Of which right.
    pub correct: u64,
    /// `correct / answers`.
    pub accuracy: f64,
    /// Mean number of cached positions of any kind on the pair's code, the
    /// pair's own included: how many keys the code's value averages. In the
    /// joint tally, of the least loaded of the pair's codes.
    pub mean_code_load: f64,
}

/// One codebook's (a sublayer's head's) tally.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CodeSharing {
    /// Sublayer.
    pub sublayer: usize,
    /// Head within the sublayer.
    pub head: usize,
    /// By how many other cached pairs share the code: 0, 1, 2-3, 4-7, ...
    pub buckets: Vec<SharingBucket>,
}

#[derive(Clone, Debug, Default)]
struct Sums {
    answers: u64,
    correct: u64,
    load: u64,
}

/// Adds an answer sharing its code with `others` other pairs, on a code of
/// `load` cached keys, to `row`'s bucket: 0, 1, 2-3, 4-7, ...
fn add(row: &mut Vec<Sums>, others: usize, load: usize, ok: bool) {
    let k = if others == 0 {
        0
    } else {
        others.ilog2() as usize + 1
    };
    if row.len() <= k {
        row.resize(k + 1, Sums::default());
    }
    row[k].answers += 1;
    row[k].correct += ok as u64;
    row[k].load += load as u64;
}

/// The non-empty buckets of `row`.
fn buckets(row: &[Sums]) -> Vec<SharingBucket> {
    (row.iter().enumerate())
        .filter(|(_, s)| s.answers > 0)
        .map(|(k, s)| SharingBucket {
            first: if k == 0 { 0 } else { 1 << (k - 1) },
            last: (1 << k) - 1,
            answers: s.answers,
            correct: s.correct,
            accuracy: s.correct as f64 / s.answers as f64,
            mean_code_load: s.load as f64 / s.answers as f64,
        })
        .collect()
}

/// Counts cached answers by how many other cached pairs share their code,
/// per codebook.
#[derive(Clone, Debug, Default)]
pub struct SharingTally {
    /// `[codebook][bucket]`, codebook `sublayer * heads + head`.
    sums: Vec<Vec<Sums>>,
    /// `[bucket]`, by the other pairs on the pair's code in every codebook.
    joint: Vec<Sums>,
    heads: usize,
}

impl SharingTally {
    /// Adds one example: `codes[c]` is codebook `c`'s code of each of the
    /// example's positions (`heads` codebooks per sublayer), `answers` its
    /// answers (positions within the example) and `right` whether each was
    /// answered right; `block_len` is the model's `L`.
    ///
    /// Answers whose source is not yet in the cache when asked for are not
    /// counted: the window, not a code, serves them.
    pub fn add_example(
        &mut self,
        codes: &[Vec<i64>],
        heads: usize,
        block_len: usize,
        answers: &[Answer],
        right: &[bool],
    ) {
        self.heads = heads.max(1);
        if self.sums.len() < codes.len() {
            self.sums.resize(codes.len(), vec![]);
        }
        let block = |p: usize| p / block_len.max(1);
        let sources: Vec<Option<usize>> = answers.iter().map(source).collect();
        for (i, (&src, &ok)) in sources.iter().zip(right).enumerate() {
            let p = answers[i].pos;
            let Some(s) = src else { continue };
            let cached = |t: usize| block(t) + 2 <= block(p);
            if !cached(s) {
                continue;
            }
            // The other cached pairs on the pair's code in every codebook so far.
            let mut everywhere: Option<Vec<usize>> = None;
            let mut least_load = usize::MAX;
            for (c, code) in codes.iter().enumerate() {
                if s >= code.len() {
                    continue;
                }
                let mine = code[s];
                let mut others: Vec<usize> = (sources.iter().flatten().copied())
                    .filter(|&t| t != s && cached(t) && code.get(t) == Some(&mine))
                    .collect();
                others.sort_unstable();
                others.dedup();
                let load = (0..code.len().min(block(p).saturating_sub(1) * block_len))
                    .filter(|&t| code[t] == mine)
                    .count();
                add(&mut self.sums[c], others.len(), load, ok);
                least_load = least_load.min(load);
                everywhere = Some(match everywhere {
                    None => others,
                    Some(e) => e.into_iter().filter(|t| others.contains(t)).collect(),
                });
            }
            if let Some(e) = everywhere {
                add(&mut self.joint, e.len(), least_load, ok);
            }
        }
    }

    /// The tally per codebook (empty when nothing was cached).
    pub fn report(&self) -> Vec<CodeSharing> {
        (self.sums.iter().enumerate())
            .filter(|(_, row)| row.iter().any(|s| s.answers > 0))
            .map(|(c, row)| CodeSharing {
                sublayer: c / self.heads,
                head: c % self.heads,
                buckets: buckets(row),
            })
            .collect()
    }

    /// The joint tally: by how many other cached pairs share the pair's code
    /// in every codebook (bucket 0: some codebook tells the pair apart from
    /// each other pair); empty when nothing was cached.
    pub fn joint(&self) -> Vec<SharingBucket> {
        buckets(&self.joint)
    }
}

/// The position that read an answer's pair: `pos - distance + 1`, where
/// that lies before the answer.
fn source(a: &Answer) -> Option<usize> {
    (a.distance >= 1 && a.distance <= a.pos).then(|| a.pos + 1 - a.distance)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(pos: usize, distance: usize) -> Answer {
        Answer { pos, distance }
    }

    #[test]
    fn sharing_is_counted_among_the_cached_pairs_only() {
        // L = 2: at position 9 (block 4) the cache holds blocks 0-2, positions 0-5.
        // Sources: 9-8+1 = 2, 9-6+1 = 4, 8-3+1 = 6 (block 3: window), 9-3+1 = 7.
        let answers = [answer(9, 8), answer(9, 6), answer(8, 3), answer(9, 3)];
        // One codebook: positions 2 and 4 share code 5; 6 has code 5 too but is
        // not cached at 8 or 9; position 0 has code 5 (not a source).
        let codes = vec![vec![5, 1, 5, 1, 5, 1, 5, 7, 1, 1]];
        let mut tally = SharingTally::default();
        tally.add_example(&codes, 1, 2, &answers, &[true, false, true, true]);
        let r = tally.report();
        assert_eq!(r.len(), 1);
        // Only the two answers from 2 and 4 are cached; each shares with the other.
        let b: Vec<_> = (r[0].buckets.iter())
            .map(|b| (b.first, b.last, b.answers, b.correct))
            .collect();
        assert_eq!(b, [(1, 1, 2, 1)]);
        // Code 5 among cached positions 0-5: positions 0, 2 and 4.
        assert_eq!(r[0].buckets[0].mean_code_load, 3.0);
    }

    #[test]
    fn pairs_alone_on_their_code_land_in_bucket_zero_and_heads_are_apart() {
        // L = 1: at position 10 the cache holds positions 0..=8.
        let answers = [answer(10, 10), answer(10, 9), answer(10, 8), answer(10, 7)];
        // Sources 1, 2, 3, 4. Head 0: all distinct. Head 1: 1, 2, 3 share a code.
        let codes = vec![
            vec![0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0],
            vec![0, 9, 9, 9, 4, 0, 0, 0, 0, 0, 0],
        ];
        let mut tally = SharingTally::default();
        tally.add_example(&codes, 2, 1, &answers, &[true, true, false, true]);
        let r = tally.report();
        assert_eq!(
            (r[0].sublayer, r[0].head, r[1].sublayer, r[1].head),
            (0, 0, 0, 1)
        );
        let rows = |c: &CodeSharing| -> Vec<_> {
            (c.buckets.iter())
                .map(|b| (b.first, b.last, b.answers, b.correct))
                .collect()
        };
        assert_eq!(rows(&r[0]), [(0, 0, 4, 3)]);
        // Head 1: source 4 alone (right); 1-3 each share with two others (2-3).
        assert_eq!(rows(&r[1]), [(0, 0, 1, 1), (2, 3, 3, 2)]);
        assert_eq!(r[1].buckets[1].mean_code_load, 3.0);
        assert_eq!(r[1].buckets[0].mean_code_load, 1.0);
    }

    #[test]
    fn the_joint_tally_counts_the_pairs_that_share_a_code_in_every_codebook() {
        // L = 1: at position 10 the cache holds positions 0..=8; sources 1-4.
        let answers = [answer(10, 10), answer(10, 9), answer(10, 8), answer(10, 7)];
        // Codebook 0: sources 1, 2 and 3 on code 9. Codebook 1: 1 and 2 on
        // code 8, 3 and 4 on code 6 (position 6 too, not a source).
        let codes = vec![
            vec![0, 9, 9, 9, 4, 0, 0, 0, 0, 0, 0],
            vec![0, 8, 8, 6, 6, 0, 6, 0, 0, 0, 0],
        ];
        let mut tally = SharingTally::default();
        tally.add_example(&codes, 1, 1, &answers, &[false, true, true, true]);
        // 1 and 2 share in both codebooks; 3 shares with 1-2, then with 4,
        // never with the same pair; 4 is alone in codebook 0.
        let joint: Vec<_> = (tally.joint().iter())
            .map(|b| (b.first, b.last, b.answers, b.correct, b.mean_code_load))
            .collect();
        // Least loads: 1 and 2: 2 (codebook 1); 3: 3 (codebook 1: 3, 4, 6);
        // 4: 1 (codebook 0).
        assert_eq!(joint, [(0, 0, 2, 2, 2.0), (1, 1, 2, 1, 2.0)]);
        // Each codebook alone sees more sharing than the two together.
        let per: Vec<Vec<_>> = (tally.report().iter())
            .map(|c| c.buckets.iter().map(|b| (b.first, b.answers)).collect())
            .collect();
        assert_eq!(per, [vec![(0, 1), (2, 3)], vec![(1, 4)]]);
    }

    #[test]
    fn nothing_cached_reports_nothing() {
        let mut tally = SharingTally::default();
        tally.add_example(&[vec![0; 8]], 1, 4, &[answer(7, 2)], &[true]);
        assert!(tally.report().is_empty());
        assert!(tally.joint().is_empty());
    }
}
