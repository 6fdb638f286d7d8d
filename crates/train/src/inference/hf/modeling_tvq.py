"""Transformer-VQ for Hugging Face transformers, as tvq computes it.

Written by `tvq export --format hf` beside the weights (tvq's own names and
layouts: linear weights stored [in, out], `y = x W`) and loaded with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`. Written
from tvq's docs/architecture.md: GAU sublayers whose keys are quantized
against a codebook, so each block of L queries attends to its own block
(causally), the previous block, and a compressed cache of everything older
(one score per code, weighted by the code's count, over the mean of its
values).

The cache of `generate()` is the recurrent state: each sublayer's previous
block, compressed cache (code counts and mean values) and the present
block's keys and values so far, so a new token costs the same at any
context length (the recurrent form; whole blocks of a prompt go through in
the block form). Inference only: no dropout,
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
        """The state of a stream that has read nothing: the previous block's
        window keys, values and codes (k, v, z), the compressed cache's code
        counts and mean values, and the present block's tokens so far (kp,
        vp, zp; fewer than L)."""
        h, k, v, s, l = self.h, self.k, self.v, self.s, self.l
        return {
            "k": torch.zeros(b, h, l, k, device=device), "v": torch.zeros(b, h, l, v, device=device),
            "z": torch.full((b, h, l), s, dtype=torch.long, device=device),
            "counts": torch.zeros(b, h, s, device=device), "means": torch.zeros(b, h, s, v, device=device),
            "kp": torch.zeros(b, h, 0, k, device=device), "vp": torch.zeros(b, h, 0, v, device=device),
            "zp": torch.zeros(b, h, 0, dtype=torch.long, device=device),
            "fresh": True,
        }

    def project(self, x):
        """x [B, T, D] -> the content queries q [B, H, T, K], the window's
        keys [B, H, T, K], values [B, H, T, V], gate [B, T, H V], codes
        [B, H, T], the bias table by distance [B|1, H, T|1, L + 1], the
        codebook [H, S, K] and the learned count weight [B, H, T, 1] (or None)."""
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
        return q, window, val, gate, codes, table, c, weight

    def forward(self, x, state):
        """The block form: x [B, T, D] (T a multiple of L, read at a block
        boundary) -> (branch [B, T, D], state after)."""
        q, kw, val, gate, codes, table, c, weight = self.project(x)
        o, state = self.attend(q, kw, val, codes, table, c, weight, state)
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
        """Each block's queries against the present block (causal), the
        previous block and the compressed cache, under one softmax. kw
        [B, H, T, K] are the window's keys."""
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
        n = state["counts"][:, :, None] + counts.cumsum(2) - counts  # [B, H, R, S]
        means = merged_means(state["counts"][:, :, None], state["means"][:, :, None], sums.cumsum(2) - sums, n)
        if weight is not None:
            weight = weight.reshape(b, h, r, l, 1)
        cache = qb @ c[None, :, None].transpose(-1, -2) + self.count_term(n, weight)  # [B, H, R, L, S]
        p = torch.softmax(torch.cat([now, prev, cache], -1), -1)  # [B, H, R, L, 2L + S]
        o = p[..., :l] @ vb + p[..., l:2 * l] @ v_prev + p[..., 2 * l:] @ means
        total = state["counts"] + counts.sum(2)
        new = dict(state, k=kb[:, :, -1], v=vb[:, :, -1], z=zb[:, :, -1], counts=total,
                   means=merged_means(state["counts"], state["means"], sums.sum(2), total), fresh=False)
        return o.reshape(b, h, t, -1), new

    def step(self, x, state):
        """The recurrent form: x [B, 1, D], the token after the present
        block's tokens in `state` -> (branch [B, 1, D], state after). The
        same scores as the block form's for that query; once the present
        block is whole it becomes the previous block, and the previous
        block enters the compressed cache."""
        q, kw, val, gate, codes, table, c, weight = self.project(x)
        b, h = q.shape[:2]
        l, s = self.l, self.s
        kp, vp = torch.cat([state["kp"], kw], 2), torch.cat([state["vp"], val], 2)  # [B, H, i + 1, .]
        zp = torch.cat([state["zp"], codes], 2)
        i = kp.shape[2] - 1
        tab = table.expand(b, h, 1, l + 1)[:, :, 0]  # [B, H, L + 1]
        d_now = i - torch.arange(i + 1, device=q.device)  # [i + 1]
        d_prev = l + i - torch.arange(l, device=q.device)  # [L]
        now = (q @ kp.transpose(-1, -2))[:, :, 0] + tab[:, :, d_now]  # [B, H, i + 1]
        prev = (q @ state["k"].transpose(-1, -2))[:, :, 0]  # [B, H, L]
        prev = prev + torch.where(d_prev <= l, tab[:, :, d_prev.clamp(max=l)], 0.0)
        if state["fresh"]:
            prev = torch.full_like(prev, float("-inf"))
        n = state["counts"][:, :, None]  # [B, H, 1, S]
        if weight is not None:
            weight = weight.reshape(b, h, 1, 1, 1)
        cache = (q @ c[None].transpose(-1, -2))[:, :, 0] + self.count_term(n, weight)[:, :, 0, 0]  # [B, H, S]
        p = torch.softmax(torch.cat([now, prev, cache], -1), -1)[:, :, None]  # [B, H, 1, i + 1 + L + S]
        o = p[..., :i + 1] @ vp + p[..., i + 1:i + 1 + l] @ state["v"] + p[..., i + 1 + l:] @ state["means"]
        out = (o.transpose(1, 2).flatten(2) * gate) @ self.out_proj.weight  # [B, 1, D]
        if i + 1 < l:
            return out, dict(state, kp=kp, vp=vp, zp=zp)
        hot = F.one_hot(state["z"], s + 1)[..., :s].to(q.dtype)  # [B, H, L, S]
        total = state["counts"] + hot.sum(2)
        means = merged_means(state["counts"], state["means"], hot.transpose(-1, -2) @ state["v"], total)
        return out, dict(state, k=kp, v=vp, z=zp, counts=total, means=means, kp=kp[:, :, :0],
                         vp=vp[:, :, :0], zp=zp[:, :, :0], fresh=False)

    def count_term(self, n, weight):
        """`w ln n_s` (a code limit caps n_s) plus the cache limit's score,
        -inf for an empty code, from the counts n [B, H, R, S] and each
        query's weight [B, H, R, Lq, 1] (None: w = 1): [B, H, R, Lq|1, S]."""
        capped = n.clamp_max(float(self.cfg.code_limit)) if self.cfg.code_limit else n
        shift = 0.0
        if self.cfg.cache_limit:
            shift = -(n.sum(-1, keepdim=True) / self.cfg.cache_limit).clamp_min(1.0).log()[..., None, :]
        if weight is None:
            return capped.log()[:, :, :, None] + shift
        term = weight * capped.clamp_min(1.0).log()[:, :, :, None] + shift
        return term.masked_fill((n == 0)[:, :, :, None], float("-inf"))


def merged_means(n_a, means_a, sums_b, n):
    """The mean values of a cache of n_a keys with means means_a [.., S, V]
    and of keys summing to sums_b, n keys in all (0 where a code is empty)."""
    safe = n.clamp_min(1.0)[..., None]
    return torch.where(n[..., None] > 0, means_a * n_a[..., None] / safe + sums_b / safe, 0.0)


class TvqCache:
    """What `generate()` carries between calls: each sublayer's state (the
    previous block, the compressed cache and the present block's tokens so
    far) and how many tokens have been read in all."""

    is_compileable = False
    is_croppable = False
    is_linear = [True]

    def __init__(self, states, seen):
        self.states, self.seen = states, seen

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
        """Logits of ids [B, T] read from `states`, and the states after
        them: whole blocks (T a multiple of L, from a block boundary) in the
        block form, a single token in the recurrent form."""
        x = self.embedding(ids)
        new = []
        for gau, state in zip(self.sublayers, states):
            out, state = gau(x, state) if ids.shape[1] > 1 else gau.step(x, state)
            x = x + out
            new.append(state)
        return self.head(x), new

    def forward(self, input_ids=None, attention_mask=None, cache=None, past_key_values=None,
                labels=None, use_cache=None, return_dict=None, **kwargs):
        """input_ids [B, T] read after what `cache` holds (from the start of
        a stream without one): logits [B, T, vocab]. Whole blocks are read
        in the block form, tokens before and after them one at a time in
        the recurrent form, so a token costs the same at any context
        length. Rows are read from their first token, so padding may only
        follow a row's tokens (right padding, as causal scoring pads);
        `generate()` with prompts of different lengths (left padding) is
        refused."""
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
            states, seen = [gau.fresh_state(b, input_ids.device) for gau in self.sublayers], 0
        else:
            states, seen = cache.states, cache.seen
        logits, start = [], 0
        while start < t:
            at_boundary = states[0]["kp"].shape[2] == 0
            whole = min((t - start) // l * l, max(l, SEGMENT // l * l)) if at_boundary else 0
            n = whole if whole > 0 else 1
            out, states = self.blocks(input_ids[:, start:start + n], states)
            logits.append(out)
            start += n
        logits = torch.cat(logits, 1)  # [B, T, vocab]
        loss = None
        if labels is not None:
            # Causal LM convention: position i predicts labels[i + 1].
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        new_cache = TvqCache(states, seen + t) if use_cache else None
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
