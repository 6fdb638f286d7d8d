//! Hyper-parameters of a Transformer-VQ network and their validation.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// Which relative-position bias the attention adds for keys at most one block
/// length away (distance `d = i - j`, `0 <= d <= L`). Keys farther away carry
/// no position term, which is what lets them be grouped by code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RelativeBias {
    /// A learned scalar per head and distance, `b_h[d]` (a banded Toeplitz matrix). Default.
    #[default]
    Toeplitz,
    /// Transformer-XL terms as in the official implementation: the content
    /// score uses `q + u`, and `bias(d) = (q + w) . (W_r sin_emb(d))`.
    Xl,
    /// Windowed rotary position (ReRoPE-style), no additive bias: the score
    /// is `q_i . R(min(i - j, L)) k_hat_j`, `R(d)` the rotary embedding's
    /// rotation by `d` positions, so every key farther than the window
    /// (the rest of the previous block, the compressed cache) sees
    /// position `L` and the cache scores stay `q . R(L) C_s`. Keys and
    /// queries also carry a position channel (`rotary_channel`). Needs an
    /// even `d_k`.
    Rotary,
}

/// How far the gradient reaches back through the attention caches inside one
/// segment. Across segments the carried state never carries gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CacheGrad {
    /// Gradient flows through the previous block's keys and values; the
    /// compressed cache is a constant. Default.
    #[default]
    Window,
    /// Only the present block receives gradient (official `grad_thru_cache = 0`).
    None,
    /// Gradient also flows into the values summarised by the compressed cache
    /// (official `grad_thru_cache = 1`).
    Full,
}

/// Which keys the two-block window (present and previous block) scores
/// against. Keys older than the window are always their codewords: that is
/// what lets the compressed cache group them by code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WindowKeys {
    /// The quantized keys `k_hat`, as in the paper and the official code. Default.
    #[default]
    Quantized,
    /// The keys themselves, unquantized: the window tells apart keys that
    /// share a code, at no extra cost (the same products, another operand).
    /// The straight-through estimator then matters only for the cache.
    Exact,
}

/// How much a code's count weighs in the compressed cache's scores,
/// `q . C_s + w ln n_s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CountWeight {
    /// `w = 1`: the paper's cache, exact attention over the quantized keys,
    /// where a code that `n_s` keys took weighs as those `n_s` keys. Default.
    #[default]
    Fixed,
    /// `w = 2 sigmoid(x W_w)` in `(0, 2)`, learned per query and head from
    /// the sublayer's input (`H` more columns of the query projection,
    /// initialised to zero, so training starts from the paper's cache): a
    /// query can damp the counts, by which the filler's codes outweigh a
    /// retrieved key's in long streams, as far as it needs
    /// (docs/learning.md, "A count weight per query").
    Learned,
}

impl CountWeight {
    /// Columns of the query projection per head that give the weight: 1
    /// when learned, else 0.
    pub fn width(self) -> usize {
        usize::from(self == CountWeight::Learned)
    }
}

/// Which attention the GAU sublayers compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum AttentionForm {
    /// Transformer-VQ: quantized keys, block-parallel, linear in sequence length. Default.
    #[default]
    Vq,
    /// Dense causal softmax attention over the unquantized keys, quadratic in
    /// sequence length, with the same relative bias. A baseline for
    /// benchmarks and ablations; it carries no state between segments.
    Quadratic,
}

/// Architecture of a [`TransformerVq`](crate::TransformerVq) language model.
///
/// Symbols follow the spec: `D = d_model`, `K = d_k`, `V = d_v`, `S = n_code`,
/// `H = n_head`, `L = block_len`, `N = n_layer` (each layer holds two GAU sublayers).
///
/// This is also the `[model]` table of a run's TOML config: missing keys take
/// the defaults of [`Default`] (the only place they are written), unknown
/// keys are an error. There `vocab_size` is left out (0): it comes from the
/// corpus's vocabulary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransformerVqConfig {
    /// Vocabulary size (0 until the vocabulary is known).
    #[serde(skip_serializing_if = "is_zero")]
    pub vocab_size: usize,
    /// Model width `D`.
    pub d_model: usize,
    /// Query/key width per head `K`.
    pub d_k: usize,
    /// Value width per head `V`.
    pub d_v: usize,
    /// Codebook size `S` (codes per head and sublayer).
    pub n_code: usize,
    /// Heads `H`; each head has its own codebook.
    pub n_head: usize,
    /// Layers `N`; each holds two GAU sublayers.
    pub n_layer: usize,
    /// Block length `L`; segments fed to the block-parallel form are a multiple of it.
    pub block_len: usize,
    /// Relative position bias.
    pub bias: RelativeBias,
    /// Initial locality of the Toeplitz bias: head `h` starts at
    /// `b_h[d] = a_h (1 - d / L)` with `a_h = toeplitz_locality 2^(-8 h / H)`,
    /// so nearer keys start favoured and the table meets the compressed
    /// cache's zero bias at `d = L`. 0 starts the table at zero.
    pub toeplitz_locality: f64,
    /// Features of the rotary position channel `P` (even; 0 for none;
    /// absent: `d_k`). With `bias = "rotary"` each key carries `P` constant
    /// features beside its codeword and each query `P` features of its own
    /// from the query projection, so a query can prefer distances whatever
    /// the key's content ([`crate::attention::Rotary`]). Ignored by the
    /// other position terms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rotary_channel: Option<usize>,
    /// Gradient through the caches within a segment.
    pub cache_grad: CacheGrad,
    /// Most keys the compressed cache weighs: once it holds `N` keys, more
    /// than `cache_limit`, each one's score drops by `ln(N / cache_limit)`,
    /// so the cache's share of the attention stays what it was at
    /// `cache_limit` keys ([`crate::attention::cache_limit_bias`]). Set to
    /// the most keys a training sequence puts in the cache (`sequence_len -
    /// 2 block_len` when the state is reset per sequence), it leaves
    /// training unchanged, and streams far longer than the training
    /// sequences no longer lose the window to the cache (docs/learning.md).
    /// Absent: no limit, the paper's cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_limit: Option<usize>,
    /// Most keys one code of the compressed cache weighs as: a code that
    /// stands for `n` cached keys scores `q . C_s + ln min(n, code_limit)`
    /// rather than `+ ln n`, so a code that many keys took (filler, frequent
    /// tokens) no longer outweighs one that a single key took by their
    /// counts, however long the stream. At 1, every code in use weighs
    /// alike: the cache's attention then depends on which codes are in use,
    /// not on how often, and recall learned on short examples holds at 64
    /// times their length (docs/learning.md, "The cache's counts"). Absent:
    /// the paper's cache, where every key weighs in full. Ignored by the
    /// quadratic form, which has no codes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code_limit: Option<usize>,
    /// How much a code's count weighs in the compressed cache's scores:
    /// fixed (the paper's) or learned per query ([`CountWeight`]). Needs
    /// the VQ form. Written only when not the default.
    #[serde(skip_serializing_if = "is_default")]
    pub count_weight: CountWeight,
    /// Attention form (VQ, or the quadratic baseline).
    pub attention: AttentionForm,
    /// Which keys the two-block window scores against (quantized, as in the
    /// paper, or exact). Ignored by the quadratic form. Written only when
    /// not the default, so configs from before it read and write the same.
    #[serde(skip_serializing_if = "is_default")]
    pub window_keys: WindowKeys,
    /// RMS-normalise the features before the output projection (reference name `e_preln`).
    pub final_norm: bool,
    /// Tie the output projection to the embedding (`logits = h E^T + b`).
    pub tie_embeddings: bool,
    /// Constant multiplier on the logits (reference name `e_scale`).
    pub logit_scale: f64,
    /// Residual dropout on each GAU output (`p_dropres`).
    pub dropout_residual: f64,
    /// Probability of dropping a whole GAU sublayer for one batch row (`p_droplyr`).
    pub dropout_layer: f64,
    /// Dropout on the XL sinusoid embedding (`p_dropsin`).
    pub dropout_sinusoid: f64,
    /// Wavelength base `lambda` of the XL sinusoid embedding (`pe_lam`).
    pub sinusoid_base: f64,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

impl Default for TransformerVqConfig {
    /// The defaults of every hyper-parameter (the recipe's small model),
    /// with the vocabulary still unknown.
    fn default() -> Self {
        Self {
            vocab_size: 0,
            d_model: 256,
            d_k: 64,
            d_v: 512,
            n_code: 128,
            n_head: 1,
            n_layer: 2,
            block_len: 128,
            bias: RelativeBias::Toeplitz,
            toeplitz_locality: 2.0,
            rotary_channel: None,
            cache_grad: CacheGrad::Window,
            cache_limit: None,
            code_limit: None,
            count_weight: CountWeight::Fixed,
            attention: AttentionForm::Vq,
            window_keys: WindowKeys::Quantized,
            final_norm: false,
            tie_embeddings: false,
            logit_scale: 1.0,
            dropout_residual: 0.0,
            dropout_layer: 0.0,
            dropout_sinusoid: 0.0,
            sinusoid_base: 100000.0,
        }
    }
}

/// `with_field(value)` builders, one per field, for configs written in code.
macro_rules! builders {
    ($($with:ident => $field:ident: $ty:ty),* $(,)?) => {
        $(
            #[doc = concat!("Sets `", stringify!($field), "`.")]
            pub fn $with(mut self, value: $ty) -> Self {
                self.$field = value;
                self
            }
        )*
    };
}

impl TransformerVqConfig {
    /// The default architecture for a vocabulary of `vocab_size` ids.
    pub fn new(vocab_size: usize) -> Self {
        Self {
            vocab_size,
            ..Self::default()
        }
    }

    builders! {
        with_vocab_size => vocab_size: usize,
        with_d_model => d_model: usize,
        with_d_k => d_k: usize,
        with_d_v => d_v: usize,
        with_n_code => n_code: usize,
        with_n_head => n_head: usize,
        with_n_layer => n_layer: usize,
        with_block_len => block_len: usize,
        with_bias => bias: RelativeBias,
        with_toeplitz_locality => toeplitz_locality: f64,
        with_rotary_channel => rotary_channel: Option<usize>,
        with_cache_grad => cache_grad: CacheGrad,
        with_cache_limit => cache_limit: Option<usize>,
        with_code_limit => code_limit: Option<usize>,
        with_count_weight => count_weight: CountWeight,
        with_attention => attention: AttentionForm,
        with_window_keys => window_keys: WindowKeys,
        with_final_norm => final_norm: bool,
        with_tie_embeddings => tie_embeddings: bool,
        with_logit_scale => logit_scale: f64,
        with_dropout_residual => dropout_residual: f64,
        with_dropout_layer => dropout_layer: f64,
        with_dropout_sinusoid => dropout_sinusoid: f64,
        with_sinusoid_base => sinusoid_base: f64,
    }

    /// Features of the rotary position channel each sublayer gets: `P`
    /// under the rotary position (`d_k` unless set), 0 otherwise.
    pub fn rotary_channel_width(&self) -> usize {
        match self.bias {
            RelativeBias::Rotary => self.rotary_channel.unwrap_or(self.d_k),
            _ => 0,
        }
    }

    /// Checks every constraint the model relies on; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("d_k", self.d_k),
            ("d_v", self.d_v),
            ("n_head", self.n_head),
            ("n_layer", self.n_layer),
            ("block_len", self.block_len),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(ConfigError::new(key, "must be at least 1"));
            }
        }
        if self.cache_limit == Some(0) {
            return Err(ConfigError::new(
                "cache_limit",
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        if self.code_limit == Some(0) {
            return Err(ConfigError::new(
                "code_limit",
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        if self.count_weight == CountWeight::Learned && self.attention == AttentionForm::Quadratic {
            return Err(ConfigError::new(
                "count_weight",
                "weighs the compressed cache's counts; the quadratic form has no cache (use \"fixed\")",
            ));
        }
        if self.n_code < 2 {
            return Err(ConfigError::new(
                "n_code",
                "the codebook needs at least 2 codes",
            ));
        }
        if self.bias == RelativeBias::Rotary && !self.d_k.is_multiple_of(2) {
            return Err(ConfigError::new(
                "d_k",
                "must be even with the rotary position (it turns pairs of features)",
            ));
        }
        if !self.rotary_channel.unwrap_or(0).is_multiple_of(2) {
            return Err(ConfigError::new(
                "rotary_channel",
                "must be even (the rotary position turns pairs of features)",
            ));
        }
        if !self.d_model.is_multiple_of(2) {
            return Err(ConfigError::new(
                "d_model",
                "must be even (the sinusoid embedding pairs sines and cosines)",
            ));
        }
        for (key, p) in [
            ("dropout_residual", self.dropout_residual),
            ("dropout_layer", self.dropout_layer),
            ("dropout_sinusoid", self.dropout_sinusoid),
        ] {
            if !(0.0..1.0).contains(&p) {
                return Err(ConfigError::new(key, "must be in [0, 1)"));
            }
        }
        if !(self.toeplitz_locality.is_finite() && self.toeplitz_locality >= 0.0) {
            return Err(ConfigError::new(
                "toeplitz_locality",
                "must be a number of at least 0",
            ));
        }
        if !(self.logit_scale.is_finite() && self.logit_scale > 0.0) {
            return Err(ConfigError::new("logit_scale", "must be a positive number"));
        }
        if !(self.sinusoid_base.is_finite() && self.sinusoid_base > 1.0) {
            return Err(ConfigError::new("sinusoid_base", "must be greater than 1"));
        }
        Ok(())
    }

    /// Number of GAU sublayers (two per layer).
    pub fn n_sublayers(&self) -> usize {
        2 * self.n_layer
    }

    /// Number of parameters (every float of the model, the EMA codebook
    /// statistics included), from the config alone: nothing is allocated,
    /// so a size can be checked before a model is built. Saturates instead
    /// of overflowing. Per GAU sublayer (`Q = K + P`, `P` the rotary
    /// position channel): the input norm `2 D`, projections `D H (Q + W)`
    /// (`W` 1 with the learned count weight, else 0),
    /// `D H (K + 2 V)` and `H V D`, the codebook `H S K + H S`, and the
    /// position term (Toeplitz `H (L + 1)`; XL `D H K + 2 H K`; rotary
    /// none); then the embedding `vocab D`, the final norm `2 D` and the
    /// output head `D vocab + vocab` (the bias `vocab` alone when tied).
    pub fn num_params(&self) -> usize {
        let [d, k, v, h, s, l, n] = [
            self.d_model,
            self.d_k,
            self.d_v,
            self.n_head,
            self.n_code,
            self.block_len,
            self.vocab_size,
        ];
        let q = k.saturating_add(self.rotary_channel_width());
        let sum = |xs: &[usize]| xs.iter().fold(0usize, |a, &x| a.saturating_add(x));
        let mul = |xs: &[usize]| xs.iter().fold(1usize, |a, &x| a.saturating_mul(x));
        let position = match self.bias {
            RelativeBias::Toeplitz => mul(&[h, l.saturating_add(1)]),
            RelativeBias::Xl => sum(&[mul(&[d, h, k]), mul(&[2, h, k])]),
            RelativeBias::Rotary => 0,
        };
        let sublayer = sum(&[
            mul(&[2, d]),
            mul(&[d, h, q.saturating_add(self.count_weight.width())]),
            mul(&[d, h, k.saturating_add(mul(&[2, v]))]),
            mul(&[h, v, d]),
            mul(&[h, s, k]),
            mul(&[h, s]),
            position,
        ]);
        let head = match self.tie_embeddings {
            true => n,
            false => sum(&[mul(&[d, n]), n]),
        };
        sum(&[
            mul(&[2, self.n_layer, sublayer]),
            mul(&[n, d]),
            if self.final_norm { mul(&[2, d]) } else { 0 },
            head,
        ])
    }

    /// The matrix products of one forward pass over `rows` segments of
    /// `seq_len` tokens (`N = rows seq_len`; the VQ form's blocks
    /// `R = seq_len / L`, as the block form needs `seq_len` a multiple of
    /// `L`). Per GAU sublayer (`Q = K + P` the query and key width with the
    /// rotary position channel `P`, `W` the learned count weight's column,
    /// 1 or 0):
    ///
    /// - projections in: `[N, D] x [D, H (Q + W)]` (queries) and
    ///   `[N, D] x [D, H (K + 2 V)]` (keys, values, gates); out:
    ///   `[N, H V] x [H V, D]`;
    /// - VQ attention: the codebook distances `H x [N, K] x [K, S]`, the
    ///   window of `2 L` keys `rows H R x [L, Q] x [Q, 2 L]` and
    ///   `[L, 2 L] x [2 L, V]`, the compressed cache of `S` codes
    ///   `rows H R x [L, K] x [K, S]` and `[L, S] x [S, V]`; the quadratic
    ///   form instead scores all `seq_len` keys,
    ///   `rows H x [seq_len, Q] x [Q, seq_len]` and
    ///   `[seq_len, seq_len] x [seq_len, V]` (the whole matrix is computed,
    ///   the causal half masked), and quantizes nothing;
    ///
    /// and once the output head, `[N, D] x [D, vocab]`. Norms, gates, the
    /// softmax, the position bias and the cache's sums are elementwise or
    /// smaller and not listed (docs/benchmarks.md).
    pub fn matrix_products(&self, rows: usize, seq_len: usize) -> Vec<MatrixProduct> {
        let [d, k, v, h, s, l] = [
            self.d_model,
            self.d_k,
            self.d_v,
            self.n_head,
            self.n_code,
            self.block_len,
        ];
        let q = k + self.rotary_channel_width();
        let w = self.count_weight.width();
        let n = rows * seq_len;
        let sublayers = self.n_sublayers();
        let each = |name, batch, m, k, n| MatrixProduct {
            name,
            count: sublayers,
            batch,
            m,
            k,
            n,
        };
        let mut products = vec![
            each("query projection", 1, n, d, h * (q + w)),
            each("key, value and gate projection", 1, n, d, h * (k + 2 * v)),
            each("output projection", 1, n, h * v, d),
        ];
        match self.attention {
            AttentionForm::Vq => {
                let blocks = rows * h * (seq_len / l);
                products.extend([
                    each("codebook distances", h, n, k, s),
                    each("window scores", blocks, l, q, 2 * l),
                    each("window values", blocks, l, 2 * l, v),
                    each("cache scores", blocks, l, k, s),
                    each("cache values", blocks, l, s, v),
                ]);
            }
            AttentionForm::Quadratic => products.extend([
                each("quadratic scores", rows * h, seq_len, q, seq_len),
                each("quadratic values", rows * h, seq_len, seq_len, v),
            ]),
        }
        products.push(MatrixProduct {
            count: 1,
            ..each("output head", 1, n, d, self.vocab_size)
        });
        products
    }

    /// Model FLOPs of one token's forward pass in a segment of `seq_len`
    /// tokens: the [`matrix_products`](Self::matrix_products) of one
    /// segment over its tokens, a multiply-add counted as 2 FLOPs. A
    /// training step costs 3 times this (the backward pass is twice the
    /// forward).
    pub fn forward_flops_per_token(&self, seq_len: usize) -> f64 {
        let products = self.matrix_products(1, seq_len);
        products.iter().map(MatrixProduct::flops).sum::<f64>() / seq_len as f64
    }
}

/// One kind of matrix product of a forward pass
/// ([`TransformerVqConfig::matrix_products`]): `count` times (once per
/// sublayer, or once) a batch of `batch` products `[m, k] x [k, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct MatrixProduct {
    /// What it computes, e.g. "window scores".
    pub name: &'static str,
    /// How many times a forward pass computes it.
    pub count: usize,
    /// Products in one batch.
    pub batch: usize,
    /// Rows of the left operand.
    pub m: usize,
    /// The shared (contracted) width.
    pub k: usize,
    /// Columns of the right operand.
    pub n: usize,
}

impl MatrixProduct {
    /// FLOPs of one batch, a multiply-add counted as 2.
    pub fn flops_once(&self) -> f64 {
        2.0 * (self.batch * self.m) as f64 * (self.k * self.n) as f64
    }

    /// FLOPs of all `count` batches of one forward pass.
    pub fn flops(&self) -> f64 {
        self.count as f64 * self.flops_once()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count of the doc comment, by hand for D 8, K 4, V 6, H 1, S 3,
    /// L 2, one layer (two sublayers), vocabulary 7. Per sublayer:
    /// projections 2·8·(4 + 4 + 12) + 2·6·8 = 416, codebook 2·3·4 = 24,
    /// window 2·4·(4 + 6) = 80, cache 2·3·(4 + 6) = 60: 580; head 2·8·7 = 112.
    #[test]
    fn forward_flops_match_a_hand_count() {
        let cfg = TransformerVqConfig::new(7)
            .with_d_model(8)
            .with_d_k(4)
            .with_d_v(6)
            .with_n_code(3)
            .with_n_layer(1)
            .with_block_len(2);
        assert_eq!(cfg.forward_flops_per_token(1024), 2.0 * 580.0 + 112.0);
        // Quadratic over 10 keys: attention 2·10·(4 + 6) = 200 instead of
        // the codebook, window and cache's 164.
        let quadratic = cfg.clone().with_attention(AttentionForm::Quadratic);
        assert_eq!(quadratic.forward_flops_per_token(10), 2.0 * 616.0 + 112.0);
        // A rotary position channel of 4 widens queries and window scores:
        // projections 2·8·(8 + 4 + 12) + 96 = 480, window 2·4·(8 + 6) = 112.
        let rotary = cfg
            .with_bias(RelativeBias::Rotary)
            .with_rotary_channel(Some(4));
        assert_eq!(rotary.forward_flops_per_token(1024), 2.0 * 676.0 + 112.0);
    }

    /// The products' shapes for several rows and heads: blocks are batched
    /// per row, head and block, the projections and head over every token,
    /// and `rows` segments cost `rows` times one segment.
    #[test]
    fn matrix_products_batch_rows_heads_and_blocks() {
        let cfg = TransformerVqConfig::new(7)
            .with_d_model(8)
            .with_d_k(4)
            .with_d_v(6)
            .with_n_code(3)
            .with_n_head(2)
            .with_n_layer(1)
            .with_block_len(2);
        let products = cfg.matrix_products(3, 8);
        let find = |name: &str| *products.iter().find(|p| p.name == name).expect(name);
        let shape = |p: MatrixProduct| [p.count, p.batch, p.m, p.k, p.n];
        // 3 rows x 2 heads x 4 blocks of 2 queries against 4 window keys.
        assert_eq!(shape(find("window scores")), [2, 24, 2, 4, 4]);
        assert_eq!(shape(find("cache values")), [2, 24, 2, 3, 6]);
        assert_eq!(shape(find("codebook distances")), [2, 2, 24, 4, 3]);
        assert_eq!(
            shape(find("key, value and gate projection")),
            [2, 1, 24, 8, 2 * 16]
        );
        assert_eq!(shape(find("output head")), [1, 1, 24, 8, 7]);
        let total: f64 = products.iter().map(MatrixProduct::flops).sum();
        assert_eq!(total, 3.0 * 8.0 * cfg.forward_flops_per_token(8));
        let quadratic = cfg
            .with_attention(AttentionForm::Quadratic)
            .matrix_products(3, 8);
        assert!(quadratic.iter().all(|p| p.name != "codebook distances"));
        let scores = quadratic
            .iter()
            .find(|p| p.name == "quadratic scores")
            .unwrap();
        assert_eq!(shape(*scores), [2, 6, 8, 4, 8]);
    }
}
