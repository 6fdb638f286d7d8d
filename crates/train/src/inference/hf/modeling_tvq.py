"""Transformer-VQ for Hugging Face transformers, as tvq computes it.

Written by `tvq export --format hf` beside the weights (tvq's own names and
layouts: linear weights stored [in, out], `y = x W`) and loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`. Written
from tvq's docs/architecture.md: GAU sublayers whose keys are quantized
against a codebook, so each block of L queries attends to its own block
(causally), the previous block, and a compressed cache of everything older
(one score per code, weighted by the code's count, over the mean of its
values).

The cache of `generate()` is the recurrent state: each sublayer's state at
the last block boundary and the tokens read since (fewer than L), so a new
token costs the same at any context length. Inference only: no dropout,
and the codebooks are not updated.

Shapes: B rows, T tokens, L block length, R blocks, D model width, H heads,
K key width, V value width, S codes.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_tvq import TvqConfig

RMS_EPS = 1e-6
MIN_COUNT = 0.01
# Most tokens read in one block-parallel pass: longer inputs go through in
# segments of about this many, the state carried (bounded memory).
SEGMENT = 4096


def rms_normalize(x):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)


def split_heads(x, h):
    """[B, T, H W] -> [B, H, T, W]."""
    b, t, hw = x.shape
    return x.reshape(b, t, h, hw // h).transpose(1, 2)


def sinusoid(n, d, base, device):
    """[sin(d w_m), then cos(d w_m)] for distances 0..n-1, w_m = base^(-2m/D): [n, D]."""
    pos = torch.arange(n, dtype=torch.float64, device=device)[:, None]
    w = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64, device=device) / d)
    angle = pos * w
    return torch.cat([angle.sin(), angle.cos()], -1).float()


class Linear(nn.Module):
    """`y = x W (+ b)`, W stored [in, out] as tvq stores it."""

    def __init__(self, n_in, n_out, bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x):
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


class RmsNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return rms_normalize(x) * self.gain + self.bias


class Quantizer(nn.Module):
    """The EMA codebook: codeword s of head h is c_sum[h, s] / c_count[h, s]."""

    def __init__(self, h, s, k):
        super().__init__()
        self.register_buffer("c_sum", torch.zeros(h, s, k))
        self.register_buffer("c_count", torch.ones(h, s))

    def codebook(self):
        return self.c_sum / self.c_count.clamp_min(MIN_COUNT)[..., None]  # [H, S, K]


class Xl(nn.Module):
    def __init__(self, d, h, k):
        super().__init__()
        self.r_proj = Linear(d, h * k)
        self.u = nn.Parameter(torch.zeros(h, k))
        self.w = nn.Parameter(torch.zeros(h, k))


class PositionBias(nn.Module):
    """Toeplitz (a scalar per head and distance 0..L) or Transformer-XL terms."""

    def __init__(self, cfg):
        super().__init__()
        self.kind = cfg.bias
        if self.kind == "toeplitz":
            self.toeplitz = nn.Parameter(torch.zeros(cfg.n_head, cfg.block_len + 1))
        elif self.kind == "xl":
            self.xl = Xl(cfg.d_model, cfg.n_head, cfg.d_k)
        else:
            raise ValueError(f"bias {self.kind!r}: this model file computes the toeplitz and xl biases")


class Gau(nn.Module):
    """One GAU sublayer with VQ attention."""

    def __init__(self, cfg):
        super().__init__()
        d, h, k, v = cfg.d_model, cfg.n_head, cfg.d_k, cfg.d_v
        self.cfg, self.h, self.k, self.v, self.s, self.l = cfg, h, k, v, cfg.n_code, cfg.block_len
        self.learned_weight = cfg.count_weight == "learned"
        self.input_norm = RmsNorm(d)
        self.q_proj = Linear(d, h * k + (h if self.learned_weight else 0))
        self.kvg_proj = Linear(d, h * (k + 2 * v))  # [W_k | W_v | W_g]
        self.out_proj = Linear(h * v, d)
        self.quantizer = Quantizer(h, cfg.n_code, k)
        self.bias = PositionBias(cfg)

    def fresh_state(self, b, device):
        """The state of a stream that has read nothing."""
        h, k, v, s, l = self.h, self.k, self.v, self.s, self.l
        return {
            "k": torch.zeros(b, h, l, k, device=device), "v": torch.zeros(b, h, l, v, device=device),
            "z": torch.full((b, h, l), s, dtype=torch.long, device=device),
            "counts": torch.zeros(b, h, s, device=device), "means": torch.zeros(b, h, s, v, device=device),
            "fresh": True,
        }

    def forward(self, x, state):
        """x [B, T, D] (T a multiple of L) -> (branch [B, T, D], state after)."""
        h, k, v = self.h, self.k, self.v
        scale = k ** -0.25  # twice applied: attention's 1/sqrt(K)
        x = self.input_norm(x)
        qw = x @ self.q_proj.weight  # [B, T, H K (+ H)]
        q = rms_normalize(split_heads(qw[..., :h * k], h)) * scale  # [B, H, T, K]
        weight = None
        if self.learned_weight:
            weight = 2 * torch.sigmoid(split_heads(qw[..., h * k:], h))  # [B, H, T, 1]
        kvg = x @ self.kvg_proj.weight
        key = rms_normalize(split_heads(kvg[..., :h * k], h)) * scale  # [B, H, T, K]
        val = split_heads(F.silu(kvg[..., h * k:h * (k + v)]), h)  # [B, H, T, V]
        gate = F.silu(kvg[..., h * (k + v):])  # [B, T, H V]
        q, table = self.position(q)
        c = self.quantizer.codebook()  # [H, S, K]
        codes = (key[..., None, :] - c[None, :, None]).square().sum(-1).argmin(-1)  # [B, H, T]
        k_hat = c[torch.arange(h, device=x.device)[None, :, None], codes]  # [B, H, T, K]
        window = key if self.cfg.window_keys == "exact" else k_hat
        o, state = self.attend(q, window, val, codes, table, c, weight, state)
        return (o.transpose(1, 2).flatten(2) * gate) @ self.out_proj.weight, state

    def position(self, q):
        """The content query and the bias table by distance 0..L, [B|1, H, T|1, L+1]."""
        if self.bias.kind == "toeplitz":
            return q, self.bias.toeplitz[None, :, None, :]
        h, k, l = self.h, self.k, self.l
        scale = k ** -0.25
        xl = self.bias.xl
        sin = sinusoid(l + 1, self.cfg.d_model, self.cfg.sinusoid_base, q.device)
        r = (sin @ xl.r_proj.weight * scale).reshape(l + 1, h, k).permute(1, 2, 0)[None]  # [1, H, K, L+1]
        table = (q + xl.w[None, :, None] * scale) @ r  # [B, H, T, L+1]
        return q + xl.u[None, :, None] * scale, table

    def attend(self, q, kw, v, z, table, c, weight, state):
        """The block form: each block's queries against the present block
        (causal), the previous block and the compressed cache, under one
        softmax. kw [B, H, T, K] are the window's keys."""
        b, h, t, k = q.shape
        l, s = self.l, self.s
        r = t // l
        qb, kb, vb, zb = (x.reshape(b, h, r, l, *x.shape[3:]) for x in (q, kw, v, z))

        def shift(carried, x):  # each block's previous block: [B, H, R, L, .]
            return torch.cat([carried[:, :, None], x[:, :, :-1]], 2)

        k_prev, v_prev, z_prev = shift(state["k"], kb), shift(state["v"], vb), shift(state["z"], zb)
        # Window scores with the bias by distance: present d = i - j, previous d = L + i - j.
        tab = table.expand(b, h, t, l + 1).reshape(b, h, r, l, l + 1)
        i = torch.arange(l, device=q.device)
        d_now, d_prev = i[:, None] - i[None, :], l + i[:, None] - i[None, :]  # [L, L]

        def gather(d):
            return torch.gather(tab, 4, d.clamp(0, l).expand(b, h, r, l, l))

        now = (qb @ kb.transpose(-1, -2) + gather(d_now)).masked_fill(d_now < 0, float("-inf"))
        prev = qb @ k_prev.transpose(-1, -2) + torch.where(d_prev <= l, gather(d_prev), 0.0)
        if state["fresh"]:
            first = torch.zeros(r, dtype=torch.bool, device=q.device)
            first[0] = True
            prev = prev.masked_fill(first[:, None, None], float("-inf"))
        # The compressed cache of block r: everything before block r - 1.
        hot = F.one_hot(z_prev, s + 1)[..., :s].to(q.dtype)  # [B, H, R, L, S]; code S counts nothing
        counts = hot.sum(3)  # [B, H, R, S]
        sums = hot.transpose(-1, -2) @ v_prev  # [B, H, R, S, V]
        n_c, mean_c = state["counts"][:, :, None], state["means"][:, :, None]
        n = n_c + counts.cumsum(2) - counts  # [B, H, R, S]
        safe = n.clamp_min(1.0)[..., None]
        means = torch.where(n[..., None] > 0, mean_c * n_c[..., None] / safe + (sums.cumsum(2) - sums) / safe, 0.0)
        cache = qb @ c[None, :, None].transpose(-1, -2)  # [B, H, R, L, S]
        cache = cache + self.count_term(n, weight, b, h, r)
        p = torch.softmax(torch.cat([now, prev, cache], -1), -1)  # [B, H, R, L, 2L + S]
        o = p[..., :l] @ vb + p[..., l:2 * l] @ v_prev + p[..., 2 * l:] @ means
        total = state["counts"] + counts.sum(2)
        safe_total = total.clamp_min(1.0)[..., None]
        total_means = state["means"] * state["counts"][..., None] / safe_total + sums.sum(2) / safe_total
        new = {
            "k": kb[:, :, -1], "v": vb[:, :, -1], "z": zb[:, :, -1],
            "counts": total, "means": torch.where(total[..., None] > 0, total_means, 0.0),
            "fresh": False,
        }
        return o.reshape(b, h, t, -1), new

    def count_term(self, n, weight, b, h, r):
        """`w ln n_s` (a code limit caps n_s) plus the cache limit's score,
        -inf for an empty code: [B, H, R, L|1, S]."""
        capped = n.clamp_max(float(self.cfg.code_limit)) if self.cfg.code_limit else n
        shift = 0.0
        if self.cfg.cache_limit:
            shift = -(n.sum(-1, keepdim=True) / self.cfg.cache_limit).clamp_min(1.0).log()[..., None, :]
        if weight is None:
            return capped.log()[:, :, :, None] + shift
        w = weight.reshape(b, h, r, self.l, 1)
        term = w * capped.clamp_min(1.0).log()[:, :, :, None] + shift
        return term.masked_fill((n == 0)[:, :, :, None], float("-inf"))


class TvqCache:
    """What `generate()` carries between calls: each sublayer's state at the
    last block boundary, the tokens read since then (`pending`, [B, < L]),
    and how many tokens have been read in all."""

    is_compileable = False
    is_croppable = False
    is_linear = [True]

    def __init__(self, states, pending, seen):
        self.states, self.pending, self.seen = states, pending, seen

    def get_seq_length(self, layer_idx=0):
        return self.seen


@dataclass
class TvqOutput(ModelOutput):
    """The logits [B, T, vocab], the mean loss when labels were given, and
    the recurrent cache."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: TvqCache | None = None


class TvqPreTrainedModel(PreTrainedModel):
    config_class = TvqConfig
    base_model_prefix = "tvq"
    _no_split_modules = ["Gau"]

    def _init_weights(self, module):
        # Weights come from tvq; a model built from a config alone starts
        # as tvq's initialisation would (fan-in scaled normal weights).
        if isinstance(module, Linear):
            nn.init.normal_(module.weight, std=module.weight.shape[0] ** -0.5)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight)


class TvqForCausalLM(TvqPreTrainedModel, GenerationMixin):
    """Embedding, 2 N GAU sublayers with residual connections, the head."""

    def __init__(self, config):
        super().__init__(config)
        if config.attention != "vq":
            raise ValueError(f"attention {config.attention!r}: this model file computes VQ attention")
        d, vocab = config.d_model, config.vocab_size
        self.embedding = nn.Embedding(vocab, d)
        self.sublayers = nn.ModuleList(Gau(config) for _ in range(2 * config.n_layer))
        if config.final_norm:
            self.final_norm = RmsNorm(d)
        if config.tie_embeddings:
            self.output_bias = nn.Parameter(torch.zeros(vocab))
        else:
            self.output = Linear(d, vocab, bias=True)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # its own recurrent cache, made by forward

    def get_input_embeddings(self):
        return self.embedding

    def set_input_embeddings(self, value):
        self.embedding = value

    def head(self, x):
        """Hidden states [B, T, D] -> logits [B, T, vocab]."""
        if self.config.final_norm:
            x = self.final_norm(x)
        if self.config.tie_embeddings:
            logits = x @ self.embedding.weight.t() + self.output_bias
        else:
            logits = self.output(x)
        return logits * self.config.logit_scale

    def blocks(self, ids, states):
        """Logits of ids [B, T] (T a multiple of L) read from `states`, and
        the states after them."""
        x = self.embedding(ids)
        new = []
        for gau, state in zip(self.sublayers, states):
            out, state = gau(x, state)
            x = x + out
            new.append(state)
        return self.head(x), new

    def forward(self, input_ids=None, attention_mask=None, cache=None, past_key_values=None,
                labels=None, use_cache=None, return_dict=None, **kwargs):
        """input_ids [B, T] read after what `cache` holds (from the start of
        a stream without one): logits [B, T, vocab]. Rows are read from
        their first token, so padding may only follow a row's tokens
        (right padding, as causal scoring pads); `generate()` with prompts
        of different lengths (left padding) is refused."""
        if input_ids is None:
            raise ValueError("tvq models read input_ids (inputs_embeds are not supported)")
        if attention_mask is not None:
            mask = attention_mask.to(torch.bool)
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError(
                    "tvq models read each row from its first token: padding may only follow a row's "
                    "tokens (right padding); generate prompts of different lengths one at a time")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        b, t = input_ids.shape
        l = self.config.block_len
        if cache is None:
            states = [gau.fresh_state(b, input_ids.device) for gau in self.sublayers]
            pending, seen = input_ids[:, :0], 0
        else:
            states, pending, seen = cache.states, cache.pending, cache.seen
        ids = torch.cat([pending, input_ids], 1)  # [B, P + T]
        done = ids.shape[1] // l * l
        logits = []
        step = max(l, SEGMENT // l * l)
        for start in range(0, done, step):
            out, states = self.blocks(ids[:, start:min(start + step, done)], states)
            logits.append(out)
        if done < ids.shape[1]:
            # The last, partial block, padded to L: its queries see no later
            # key, so the padding changes nothing they compute; the state
            # stays at the block boundary.
            rest = ids[:, done:]
            padded = F.pad(rest, (0, l - rest.shape[1]), value=self.config.pad_token_id or 0)
            out, _ = self.blocks(padded, states)
            logits.append(out[:, :rest.shape[1]])
        logits = torch.cat(logits, 1)[:, pending.shape[1]:]  # [B, T, vocab]
        loss = None
        if labels is not None:
            # Causal LM convention: position i predicts labels[i + 1].
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        new_cache = None
        if use_cache:
            new_cache = TvqCache(states, ids[:, done:], seen + t)
        return TvqOutput(loss=loss, logits=logits, cache=new_cache)

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None,
                                      attention_mask=None, use_cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            input_ids = input_ids[:, cache.seen:]
            if attention_mask is not None:
                attention_mask = attention_mask[:, cache.seen:]
        return {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask,
                "use_cache": use_cache}
