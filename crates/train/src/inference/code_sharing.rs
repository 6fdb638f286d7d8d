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

use std::collections::{HashMap, VecDeque};

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
fn add(row: &mut Vec<Sums>, others: u64, load: u64, ok: bool) {
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
    row[k].load += load;
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
/// per codebook and in every codebook at once, over examples read through
/// [`ExampleSharing`].
#[derive(Clone, Debug, Default)]
pub struct SharingTally {
    /// `[codebook][bucket]`, codebook `sublayer * heads + head`.
    sums: Vec<Vec<Sums>>,
    /// `[bucket]`, by the other pairs on the pair's code in every codebook.
    joint: Vec<Sums>,
    heads: usize,
}

impl SharingTally {
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

/// One example's contribution to a [`SharingTally`], read segment by
/// segment as the model reads it.
///
/// Time and memory grow with the example's length and answers, not with
/// their product: positions enter running counts per code as they join
/// the cache, and only the codes of the last two blocks and of the answers'
/// sources are kept.
#[derive(Clone, Debug)]
pub struct ExampleSharing {
    block_len: usize,
    /// The example's answers, by position.
    answers: Vec<Answer>,
    /// Each answer's source, where it has one.
    sources: Vec<Option<usize>>,
    /// The distinct sources, ascending, and their codes (`[codebook]`, once read).
    source_positions: Vec<usize>,
    source_codes: Vec<Vec<u32>>,
    /// Positions read so far.
    read: usize,
    /// Positions `..counted` are in the running counts below.
    counted: usize,
    /// Codes of positions `counted..read`, position-major.
    pending: VecDeque<u32>,
    /// `[codebook]`: cached keys on each code (empty until the first
    /// segment says how many codebooks there are).
    loads: Vec<HashMap<u32, u64>>,
    /// `[codebook]`: cached sources on each code.
    pairs: Vec<HashMap<u32, u64>>,
    /// Cached sources on each tuple of codes, one code per codebook.
    joint: HashMap<Vec<u32>, u64>,
    /// Answers already tallied (they are by position).
    next_answer: usize,
}

impl ExampleSharing {
    /// An example about to be read by a model of blocks of `block_len`
    /// tokens, with `answers` (positions within the example, ascending).
    pub fn new(answers: Vec<Answer>, block_len: usize) -> Self {
        let sources: Vec<Option<usize>> = answers.iter().map(source).collect();
        let mut source_positions: Vec<usize> = sources.iter().flatten().copied().collect();
        source_positions.sort_unstable();
        source_positions.dedup();
        Self {
            block_len: block_len.max(1),
            source_codes: vec![vec![]; source_positions.len()],
            answers,
            sources,
            source_positions,
            read: 0,
            counted: 0,
            pending: VecDeque::new(),
            loads: vec![],
            pairs: vec![],
            joint: HashMap::new(),
            next_answer: 0,
        }
    }

    /// Reads the next segment: `codes[c]` is codebook `c`'s code of each of
    /// its positions (`heads` codebooks per sublayer, every one as long) and
    /// `right[i]` whether an answer at its position `i` was right. Tallies
    /// into `tally` the segment's answers whose source is in the cache when
    /// they are asked for; the others the window, not a code, serves.
    pub fn add_segment(
        &mut self,
        codes: &[Vec<u32>],
        heads: usize,
        right: &[bool],
        tally: &mut SharingTally,
    ) {
        let len = codes.first().map_or(0, Vec::len);
        if self.loads.is_empty() {
            self.loads = vec![HashMap::new(); codes.len()];
            self.pairs = vec![HashMap::new(); codes.len()];
        }
        let codebooks = self.loads.len();
        if codes.len() != codebooks || codes.iter().any(|c| c.len() != len) {
            return; // not the layout of the segments before: nothing to count
        }
        tally.heads = heads.max(1);
        if tally.sums.len() < codebooks {
            tally.sums.resize(codebooks, vec![]);
        }
        let (start, end) = (self.read, self.read + len);
        for i in 0..len {
            self.pending.extend(codes.iter().map(|c| c[i]));
        }
        // The codes of the sources in this segment.
        let from = self.source_positions.partition_point(|&t| t < start);
        let to = self.source_positions.partition_point(|&t| t < end);
        for k in from..to {
            let t = self.source_positions[k] - start;
            self.source_codes[k] = codes.iter().map(|c| c[t]).collect();
        }
        self.read = end;
        while let Some(a) = self.answers.get(self.next_answer).copied() {
            if a.pos >= end {
                break;
            }
            let i = self.next_answer;
            self.next_answer += 1;
            if a.pos < start {
                continue; // in a segment that came without its codes
            }
            // Position `t` is in the cache at `p` when its block lies at least
            // two blocks before `p`'s: `t < (p / L - 1) L`.
            let cache_end = (a.pos / self.block_len).saturating_sub(1) * self.block_len;
            self.count_up_to(cache_end);
            let Some(s) = self.sources[i].filter(|&s| s < cache_end) else {
                continue;
            };
            let k = self.source_positions.partition_point(|&t| t < s);
            let mine = &self.source_codes[k];
            let ok = right.get(a.pos - start).copied().unwrap_or(false);
            let mut least_load = u64::MAX;
            for (c, &code) in mine.iter().enumerate() {
                let load = self.loads[c].get(&code).copied().unwrap_or(0);
                let others = self.pairs[c].get(&code).map_or(0, |n| n - 1);
                add(&mut tally.sums[c], others, load, ok);
                least_load = least_load.min(load);
            }
            let others = self.joint.get(mine).map_or(0, |n| n - 1);
            add(&mut tally.joint, others, least_load, ok);
        }
    }

    /// Moves positions `counted..end` (at most those read) into the counts.
    fn count_up_to(&mut self, end: usize) {
        let n = self.loads.len();
        while self.counted < end.min(self.read) {
            let t = self.counted;
            let codes: Vec<u32> = self.pending.drain(..n).collect();
            for (c, &code) in codes.iter().enumerate() {
                *self.loads[c].entry(code).or_default() += 1;
            }
            if self.source_positions.binary_search(&t).is_ok() {
                for (c, &code) in codes.iter().enumerate() {
                    *self.pairs[c].entry(code).or_default() += 1;
                }
                *self.joint.entry(codes).or_default() += 1;
            }
            self.counted += 1;
        }
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

    /// The tally of one example read in segments of `seg` positions, with
    /// `right[i]` whether `answers[i]` was right.
    fn read(
        codes: &[Vec<u32>],
        heads: usize,
        block_len: usize,
        answers: &[Answer],
        right: &[bool],
        seg: usize,
    ) -> SharingTally {
        let len = codes[0].len();
        let mut at = vec![false; len];
        for (a, &ok) in answers.iter().zip(right) {
            at[a.pos] = ok;
        }
        let (mut tally, mut example) = (
            SharingTally::default(),
            ExampleSharing::new(answers.to_vec(), block_len),
        );
        for start in (0..len).step_by(seg) {
            let end = (start + seg).min(len);
            let part: Vec<Vec<u32>> = codes.iter().map(|c| c[start..end].to_vec()).collect();
            example.add_segment(&part, heads, &at[start..end], &mut tally);
        }
        tally
    }

    /// Each bucket as `(first, last, answers, correct)`.
    fn rows(buckets: &[SharingBucket]) -> Vec<(u64, u64, u64, u64)> {
        (buckets.iter())
            .map(|b| (b.first, b.last, b.answers, b.correct))
            .collect()
    }

    #[test]
    fn sharing_is_counted_among_the_pairs_cached_when_asked() {
        // L = 2: an answer at p sees positions before (p / 2 - 1) * 2 cached.
        // Answer 8 (source 6): cache 0-5, not counted. Answer 9 (source 2):
        // cache 0-5. Answer 10 (source 4): cache 0-7. Answer 11 (source 9):
        // not counted.
        let answers = [answer(8, 3), answer(9, 8), answer(10, 7), answer(11, 3)];
        // Sources 2, 4 and 6 on code 5, and position 0 (not a source).
        let codes = vec![vec![5, 1, 5, 1, 5, 1, 5, 7, 1, 1, 1, 1]];
        let tally = read(&codes, 1, 2, &answers, &[true, true, false, true], 12);
        let r = tally.report();
        assert_eq!(r.len(), 1);
        // At 9 source 2 shares with 4 (6 is not cached yet); at 10 source 4
        // shares with 2 and 6.
        assert_eq!(rows(&r[0].buckets), [(1, 1, 1, 1), (2, 3, 1, 0)]);
        // Code 5 on 0, 2, 4 of 0-5; on 0, 2, 4, 6 of 0-7.
        let loads: Vec<f64> = r[0].buckets.iter().map(|b| b.mean_code_load).collect();
        assert_eq!(loads, [3.0, 4.0]);
    }

    #[test]
    fn pairs_alone_on_their_code_land_in_bucket_zero_and_heads_are_apart() {
        // L = 1: answers at 7-10 from sources 1-4, all cached.
        let answers = [answer(7, 7), answer(8, 7), answer(9, 7), answer(10, 7)];
        // Head 0: all distinct. Head 1: 1, 2, 3 share a code.
        let codes = vec![
            vec![0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0],
            vec![0, 9, 9, 9, 4, 0, 0, 0, 0, 0, 0],
        ];
        let tally = read(&codes, 2, 1, &answers, &[true, true, false, true], 11);
        let r = tally.report();
        assert_eq!(
            (r[0].sublayer, r[0].head, r[1].sublayer, r[1].head),
            (0, 0, 0, 1)
        );
        assert_eq!(rows(&r[0].buckets), [(0, 0, 4, 3)]);
        // Head 1: source 4 alone (right); 1-3 each share with two others (2-3).
        assert_eq!(rows(&r[1].buckets), [(0, 0, 1, 1), (2, 3, 3, 2)]);
        assert_eq!(r[1].buckets[1].mean_code_load, 3.0);
        assert_eq!(r[1].buckets[0].mean_code_load, 1.0);
    }

    #[test]
    fn the_joint_tally_counts_the_pairs_that_share_a_code_in_every_codebook() {
        // L = 1: answers at 8-11 from sources 1-4, with positions 0-6 cached.
        let answers = [answer(8, 8), answer(9, 8), answer(10, 8), answer(11, 8)];
        // Codebook 0: sources 1, 2 and 3 on code 9. Codebook 1: 1 and 2 on
        // code 8, 3 and 4 on code 6 (position 6 too, not a source).
        let codes = vec![
            vec![0, 9, 9, 9, 4, 0, 0, 0, 0, 0, 0, 0],
            vec![0, 8, 8, 6, 6, 0, 6, 0, 0, 0, 0, 0],
        ];
        let tally = read(&codes, 1, 1, &answers, &[false, true, true, true], 12);
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
        let tally = read(&[vec![0; 8]], 1, 4, &[answer(7, 2)], &[true], 8);
        assert!(tally.report().is_empty());
        assert!(tally.joint().is_empty());
    }

    /// The tally as defined, answer by answer over the whole example: the
    /// oracle for the streaming count.
    fn oracle(
        codes: &[Vec<u32>],
        heads: usize,
        block_len: usize,
        answers: &[Answer],
        right: &[bool],
    ) -> SharingTally {
        let mut tally = SharingTally {
            sums: vec![vec![]; codes.len()],
            joint: vec![],
            heads,
        };
        let sources: Vec<Option<usize>> = answers.iter().map(source).collect();
        for (i, a) in answers.iter().enumerate() {
            let cache_end = (a.pos / block_len).saturating_sub(1) * block_len;
            let Some(s) = sources[i].filter(|&s| s < cache_end) else {
                continue;
            };
            let mut cached: Vec<usize> = (sources.iter().flatten().copied())
                .filter(|&t| t != s && t < cache_end)
                .collect();
            cached.sort_unstable();
            cached.dedup();
            let same = |c: usize, t: usize| codes[c][t] == codes[c][s];
            let mut least_load = u64::MAX;
            for c in 0..codes.len() {
                let others = cached.iter().filter(|&&t| same(c, t)).count() as u64;
                let load = (0..cache_end).filter(|&t| same(c, t)).count() as u64;
                add(&mut tally.sums[c], others, load, right[i]);
                least_load = least_load.min(load);
            }
            let everywhere = (cached.iter())
                .filter(|&&t| (0..codes.len()).all(|c| same(c, t)))
                .count() as u64;
            add(&mut tally.joint, everywhere, least_load, right[i]);
        }
        tally
    }

    #[test]
    fn reading_in_segments_counts_as_the_definition_does() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for _ in 0..200 {
            let (len, block_len, heads) = (8 + next(120), 1 + next(8), 1 + next(3));
            let (codebooks, symbols) = (heads * (1 + next(3)), 1 + next(6));
            let codes: Vec<Vec<u32>> = (0..codebooks)
                .map(|_| (0..len).map(|_| next(symbols) as u32).collect())
                .collect();
            // Answers at distinct positions, ascending; some without a source.
            let mut answers = vec![];
            for pos in 1..len {
                if next(3) == 0 {
                    answers.push(answer(pos, next(pos + 2)));
                }
            }
            let right: Vec<bool> = answers.iter().map(|_| next(2) == 0).collect();
            let want = oracle(&codes, heads, block_len, &answers, &right);
            let seg = 1 + next(len);
            let got = read(&codes, heads, block_len, &answers, &right, seg);
            assert_eq!(got.report(), want.report(), "{len} {block_len} {seg}");
            assert_eq!(got.joint(), want.joint(), "{len} {block_len} {seg}");
        }
    }
}
