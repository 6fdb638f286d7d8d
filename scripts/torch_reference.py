"""Transformer-VQ in PyTorch, as tvq computes it: a second oracle for tvq
and its peer on a GPU. Written from docs/architecture.md (not a port of
any code): GAU sublayers, the vector quantizer with the straight-through
estimator and EMA codebooks, the block form (present block, previous block,
compressed cache), the Toeplitz and XL biases, the same loss.

    # tvq's validation loss of an export, from Python (f32):
    python3 scripts/torch_reference.py eval --export model.safetensors --text data/kjv.txt

    # the training step (AdamW, EMA), eager and torch.compile, and a
    # quadratic baseline of the same widths on scaled_dot_product_attention:
    python3 scripts/torch_reference.py bench --device cuda --seq-len 8192,32768

    # the model's matrix products at its own shapes, in PyTorch, read from
    # `tvq bench products --json` (the same shapes, side by side):
    python3 scripts/torch_reference.py products --device cuda --from products.jsonl

Shapes: B rows, T tokens, L block length, R = T / L blocks, D model width,
H heads, K key width, V value width, S codes. Needs only torch.
"""

import argparse
import json
import math
import struct
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402 (after the filter: torch warns on import without NumPy)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

RMS_EPS = 1e-6
MIN_COUNT = 0.01
EOS = 1  # byte-level ids: 0 pad, 1 end of document, 2 unknown, byte b is b + 3
PAD = 0


# --- weights ----------------------------------------------------------------

def read_safetensors(path):
    """Every tensor of a safetensors file, by name (f32, or f16/bf16 as f32)."""
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in dtypes:
            raise SystemExit(f"{path}: tensor {name} is {meta['dtype']}, not a float")
        start, end = meta["data_offsets"]
        t = torch.frombuffer(bytearray(body[start:end]), dtype=dtypes[meta["dtype"]])
        out[name] = t.reshape(meta["shape"]).float()
    return out


# --- the model ----------------------------------------------------------------

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


class Gau(nn.Module):
    """One GAU sublayer with VQ attention (or, `quadratic_sdpa`, plain
    causal attention through scaled_dot_product_attention)."""

    def __init__(self, cfg, quadratic_sdpa=False):
        super().__init__()
        d, h, k, v, s, l = (cfg[n] for n in ("d_model", "n_head", "d_k", "d_v", "n_code", "block_len"))
        self.h, self.k, self.v, self.s, self.l = h, k, v, s, l
        self.cfg, self.sdpa = cfg, quadratic_sdpa
        normal = lambda *shape, std: nn.Parameter(torch.randn(*shape) * std)
        self.gain, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.w_q = normal(d, h * k, std=d ** -0.5)
        self.w_kvg = normal(d, h * (k + 2 * v), std=d ** -0.5)  # [W_k | W_v | W_g]
        self.w_o = normal(h * v, d, std=(h * v) ** -0.5)
        self.register_buffer("c_sum", torch.randn(h, s, k) / math.sqrt(s * h))
        self.register_buffer("c_count", torch.ones(h, s))
        self.kind = cfg.get("bias", "toeplitz")
        if self.kind == "toeplitz":
            a = cfg.get("toeplitz_locality", 2.0) * 2.0 ** (-8.0 * torch.arange(h) / h)
            self.toeplitz = nn.Parameter(a[:, None] * (1 - torch.arange(l + 1) / l))  # [H, L+1]
        elif self.kind == "xl":
            self.w_r = normal(d, h * k, std=d ** -0.5)
            self.u, self.w = nn.Parameter(torch.zeros(h, k)), nn.Parameter(torch.zeros(h, k))
        else:
            raise SystemExit(f"bias {self.kind!r}: the reference has the toeplitz and xl biases")

    def codebook(self):
        return self.c_sum / self.c_count.clamp_min(MIN_COUNT)[..., None]  # [H, S, K]

    def project(self, x):
        h, k, v = self.h, self.k, self.v
        scale = k ** -0.25  # twice applied: attention's 1/sqrt(K)
        x = rms_normalize(x) * self.gain + self.bias
        kvg = x @ self.w_kvg
        q = rms_normalize(split_heads(x @ self.w_q, h)) * scale  # [B, H, T, K]
        key = rms_normalize(split_heads(kvg[..., :h * k], h)) * scale  # [B, H, T, K]
        val = split_heads(F.silu(kvg[..., h * k:h * (k + v)]), h)  # [B, H, T, V]
        gate = F.silu(kvg[..., h * (k + v):])  # [B, T, H V]
        return q, key, val, gate

    def position(self, q):
        """The content query and the bias table by distance 0..L, [B|1, H, T|1, L+1]."""
        h, k, l = self.h, self.k, self.l
        if self.kind == "toeplitz":
            return q, self.toeplitz[None, :, None, :]
        scale = k ** -0.25
        sin = sinusoid(l + 1, self.cfg["d_model"], self.cfg.get("sinusoid_base", 100000.0), q.device)
        r = (sin @ self.w_r * scale).reshape(l + 1, h, k).permute(1, 2, 0)[None]  # [1, H, K, L+1]
        table = (q + self.w[None, :, None] * scale) @ r  # [B, H, T, L+1]
        return q + self.u[None, :, None] * scale, table

    def forward(self, x, state, valid=None):
        """x [B, T, D] -> (branch [B, T, D], commitment [B, T], stats, state)."""
        q, key, val, gate = self.project(x)
        if self.sdpa:
            o = F.scaled_dot_product_attention(q, key, val, is_causal=True, scale=1.0)
            out = o.transpose(1, 2).flatten(2) * gate @ self.w_o
            return out, x.new_zeros(x.shape[:2]), None, state
        q, table = self.position(q)
        c = self.codebook()  # [H, S, K]
        dist = (key[..., None, :] - c[None, :, None]).square().sum(-1)  # [B, H, T, S]
        codes = dist.argmin(-1)  # [B, H, T]
        c_z = c[torch.arange(self.h, device=x.device)[None, :, None], codes]  # [B, H, T, K]
        k_hat = key + (c_z - key).detach()  # straight-through
        commitment = (key - c_z.detach()).square().sum(-1).sum(1)  # [B, T]
        w = torch.ones_like(codes[:, 0], dtype=x.dtype) if valid is None else valid.to(x.dtype)  # [B, T]
        onehot = F.one_hot(codes, self.s).to(x.dtype) * w[:, None, :, None]  # [B, H, T, S]
        stats = (onehot.sum((0, 2)), torch.einsum("bhts,bhtk->hsk", onehot, key.detach()))
        o, state = self.attend(q, k_hat, val, codes, table, c, state)
        out = o.transpose(1, 2).flatten(2) * gate @ self.w_o  # [B, T, D]
        return out, commitment, stats, state

    def attend(self, q, k_hat, v, z, table, c, state):
        """The block form: every block's present block, previous block and
        compressed cache under one softmax."""
        b, h, t, k = q.shape
        l, s, dv = self.l, self.s, self.v
        r = t // l
        grad = self.cfg.get("cache_grad", "window")
        qb, kb, vb, zb = (x.reshape(b, h, r, l, *x.shape[3:]) for x in (q, k_hat, v, z))
        if state is None:
            state = {
                "k": q.new_zeros(b, h, l, k), "v": q.new_zeros(b, h, l, dv),
                "z": torch.full((b, h, l), s, dtype=torch.long, device=q.device),
                "counts": q.new_zeros(b, h, s), "means": q.new_zeros(b, h, s, dv), "fresh": True,
            }
        shift = lambda carried, x: torch.cat([carried[:, :, None], x[:, :, :-1]], 2)
        window = (lambda x: x.detach()) if grad == "none" else (lambda x: x)
        k_prev, v_prev = shift(state["k"], window(kb)), shift(state["v"], window(vb))  # [B, H, R, L, .]
        z_prev = shift(state["z"], zb)  # [B, H, R, L]
        # Window scores with the bias by distance: present d = i - j, previous d = L + i - j.
        tab = table.expand(b, h, t, l + 1).reshape(b, h, r, l, l + 1)
        i = torch.arange(l, device=q.device)
        d_now, d_prev = i[:, None] - i[None, :], l + i[:, None] - i[None, :]  # [L, L]
        gather = lambda d: torch.gather(tab, 4, d.clamp(0, l).expand(b, h, r, l, l))
        now = qb @ kb.transpose(-1, -2) + gather(d_now)
        now = now.masked_fill(d_now < 0, float("-inf"))
        prev = qb @ k_prev.transpose(-1, -2) + torch.where(d_prev <= l, gather(d_prev), 0.0)
        if state["fresh"]:
            first = torch.zeros(r, dtype=torch.bool, device=q.device)
            first[0] = True
            prev = prev.masked_fill(first[:, None, None], float("-inf"))
        # The compressed cache of block r: everything before block r - 1.
        hot = F.one_hot(z_prev, s + 1)[..., :s].to(q.dtype)  # [B, H, R, L, S]; the sentinel S counts nothing
        values = v_prev if grad == "full" else v_prev.detach()
        counts = hot.sum(3)  # [B, H, R, S]
        sums = hot.transpose(-1, -2) @ values  # [B, H, R, S, V]
        before_n = counts.cumsum(2) - counts
        before_sums = sums.cumsum(2) - sums
        n_c, mean_c = state["counts"][:, :, None], state["means"][:, :, None]
        n = n_c + before_n  # [B, H, R, S]
        safe = n.clamp_min(1.0)[..., None]
        means = torch.where(n[..., None] > 0, mean_c * n_c[..., None] / safe + before_sums / safe, 0.0)
        log_n = n.log()
        limit = self.cfg.get("cache_limit")
        if limit:
            log_n = log_n - (n.sum(-1, keepdim=True) / limit).clamp_min(1.0).log()
        cache = qb @ c[None, :, None].transpose(-1, -2) + log_n[:, :, :, None, :]  # [B, H, R, L, S]
        scores = torch.cat([now, prev, cache], -1)  # [B, H, R, L, 2L + S]
        p = torch.softmax(scores, -1)
        o = p[..., :l] @ vb + p[..., l:2 * l] @ v_prev + p[..., 2 * l:] @ means
        # Carried on: the last block, and the cache with every block's previous block.
        total_n = state["counts"] + counts.sum(2)
        safe_total = total_n.clamp_min(1.0)[..., None]
        total_means = state["means"] * state["counts"][..., None] / safe_total + sums.sum(2) / safe_total
        new = {
            "k": kb[:, :, -1].detach(), "v": vb[:, :, -1].detach(), "z": zb[:, :, -1],
            "counts": total_n.detach(),
            "means": torch.where(total_n[..., None] > 0, total_means, 0.0).detach(),
            "fresh": False,
        }
        return o.reshape(b, h, t, dv), new


class TransformerVq(nn.Module):
    """Embedding, 2 N GAU sublayers with residual connections, the head."""

    def __init__(self, cfg, quadratic_sdpa=False):
        super().__init__()
        self.cfg = cfg
        d, vocab = cfg["d_model"], cfg["vocab_size"]
        self.embedding = nn.Parameter(torch.randn(vocab, d))
        self.sublayers = nn.ModuleList(Gau(cfg, quadratic_sdpa) for _ in range(2 * cfg["n_layer"]))
        self.final_norm = cfg.get("final_norm", False)
        if self.final_norm:
            self.norm_gain, self.norm_bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.tied = cfg.get("tie_embeddings", False)
        if not self.tied:
            self.w_out = nn.Parameter(torch.randn(d, vocab) * d ** -0.5)
        self.out_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens, states=None, valid=None):
        """tokens [B, T] -> logits [B, T, vocab], commitment [B, T], stats, states."""
        h = self.embedding[tokens]  # [B, T, D]
        states = states or [None] * len(self.sublayers)
        commitment, stats, new = 0.0, [], []
        for gau, state in zip(self.sublayers, states):
            out, commit, st, state = gau(h, state, valid)
            h = h + out
            commitment = commitment + commit
            stats.append(st)
            new.append(state)
        if self.final_norm:
            h = rms_normalize(h) * self.norm_gain + self.norm_bias
        w = self.embedding.t() if self.tied else self.w_out
        logits = (h @ w + self.out_bias) * self.cfg.get("logit_scale", 1.0)
        return logits, commitment, stats, new

    @torch.no_grad()
    def update_codebooks(self, stats, gamma):
        """The EMA update: c_sum <- g c_sum + (1 - g) sums, likewise the counts."""
        for gau, st in zip(self.sublayers, stats):
            if st is not None:
                gau.c_count.mul_(gamma).add_((1 - gamma) * st[0])
                gau.c_sum.mul_(gamma).add_((1 - gamma) * st[1])


def load_export(path):
    """A `tvq export` (FILE.safetensors and FILE.json) as a TransformerVq."""
    info = json.load(open(path[:-len(".safetensors")] + ".json"))
    cfg = info["model"]
    if cfg.get("attention", "vq") != "vq":
        raise SystemExit("the reference computes VQ attention only")
    model = TransformerVq(cfg)
    w = read_safetensors(path)
    named = {"embedding": "embedding.weight", "out_bias": "output.bias" if not model.tied else "output_bias",
             "w_out": "output.weight", "norm_gain": "final_norm.gain", "norm_bias": "final_norm.bias"}
    per = {"gain": "input_norm.gain", "bias": "input_norm.bias", "w_q": "q_proj.weight",
           "w_kvg": "kvg_proj.weight", "w_o": "out_proj.weight", "c_sum": "quantizer.c_sum",
           "c_count": "quantizer.c_count", "toeplitz": "bias.toeplitz", "w_r": "bias.xl.r_proj.weight",
           "u": "bias.xl.u", "w": "bias.xl.w"}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        parts = name.split(".")
        key = f"sublayers.{parts[1]}.{per[parts[2]]}" if parts[0] == "sublayers" else named[name]
        if key not in w:
            raise SystemExit(f"{path}: no tensor {key}")
        if tuple(w[key].shape) != tuple(t.shape):
            raise SystemExit(f"{path}: {key} is {list(w[key].shape)}, expected {list(t.shape)}")
        t.data.copy_(w[key])
    return model.eval(), info


# --- evaluation ---------------------------------------------------------------

def split_tokens(text_path, split):
    """A byte-level text file's split (90 / 5 / 5 of the bytes) as ids."""
    data = open(text_path, "rb").read()
    n = len(data)
    lo, hi = {"train": (0, n * 9 // 10), "validation": (n * 9 // 10, n * 19 // 20),
              "test": (n * 19 // 20, n)}[split]
    return torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.uint8).long() + 3


@torch.no_grad()
def evaluate(model, tokens, batch, update_len, max_segments=None):
    """tvq eval's protocol: the split cut into `batch` equal rows, read in
    segments of `update_len` with the state carried; each row's first input
    is the end-of-document token; mean loss over the valid tokens, nats."""
    n = len(tokens)
    region = -(-n // batch)
    segments = -(-region // update_len)
    if max_segments:
        segments = min(segments, max_segments)
    states, nll, count = None, 0.0, 0
    for seg in range(segments):
        inputs = torch.full((batch, update_len), PAD)
        targets = torch.full((batch, update_len), PAD)
        valid = torch.zeros(batch, update_len, dtype=torch.bool)
        for row in range(batch):
            start, end = row * region, min((row + 1) * region, n)
            i = torch.arange(seg * update_len, (seg + 1) * update_len)
            p = start + i
            ok = p < end
            targets[row, ok] = tokens[p[ok]]
            prev = tokens[(p[ok] - 1).clamp_min(0)]
            inputs[row, ok] = torch.where(i[ok] == 0, EOS, prev)
            valid[row] = ok
        logits, _, _, states = model(inputs, states, valid)
        token_nll = F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), reduction="none")
        nll += token_nll[valid.flatten()].sum().item()
        count += int(valid.sum())
    return nll / count, count


# --- the training step and the benchmark -------------------------------------------

def training_step(model, opt, tokens, precision, commit_weight=1e-4, gamma=0.99, clip=1.0):
    """Forward, backward, global-norm clipping, AdamW and the EMA update."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits, commitment, stats, _ = model(tokens)
        # The next token as target (the last wraps around: the same work).
        ce = F.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss = ce + commit_weight * commitment.float().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.update_codebooks(stats, gamma)
    return loss.detach()


def optimizer(model, lr=1e-3, weight_decay=2e-4):
    """AdamW, weight decay on the matrices only (as tvq's groups)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))


def flops_per_token(cfg, t, quadratic):
    """Model FLOPs of one training token, counted as tvq counts them."""
    d, k, v, h, s, l = (cfg[n] for n in ("d_model", "d_k", "d_v", "n_head", "n_code", "block_len"))
    proj = 2 * d * (h * k + h * k + 2 * h * v) + 2 * h * v * d
    att = 2 * h * t * (k + v) if quadratic else 2 * h * s * k + 2 * h * 2 * l * (k + v) + 2 * h * s * (k + v)
    return 3 * (2 * cfg["n_layer"] * (proj + att) + 2 * d * cfg["vocab_size"])


def bench_config(args):
    """The model of `--widths`: tvq bench's default model, the enwik8
    config's widths, or a tiny one (`--small`)."""
    widths = "small" if args.small else args.widths
    if widths == "small":
        return dict(vocab_size=259, d_model=64, d_k=16, d_v=64, n_code=16, n_head=1, n_layer=1,
                    block_len=64, bias="toeplitz", final_norm=True, tie_embeddings=True)
    if widths == "bench":
        # TransformerVqConfig's defaults, tvq bench's model.
        return dict(vocab_size=259, d_model=256, d_k=64, d_v=512, n_code=128, n_head=1,
                    n_layer=args.layers, block_len=128, bias="toeplitz")
    # configs/enwik8.toml's widths (its bias, XL), dropout off.
    return dict(vocab_size=259, d_model=768, d_k=128, d_v=1536, n_code=512, n_head=1,
                n_layer=args.layers, block_len=512, bias="xl", cache_grad="none")


def bench(args):
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = bench_config(args)
    for t in args.seq_len:
        for precision in args.precision:
            for impl in args.impl:
                row = {"form": "torch", "impl": impl, "seq_len": t, "batch": args.batch, "precision": precision,
                       "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "torch": torch.__version__}
                row["flops_per_token"] = flops_per_token(cfg, t, impl == "sdpa")
                try:
                    model = TransformerVq(cfg, quadratic_sdpa=impl == "sdpa").to(device)
                    opt = optimizer(model)
                    step = training_step
                    if impl == "compiled":
                        model = torch.compile(model)
                    tokens = (torch.arange(args.batch * t, device=device) * 31 % 256 + 3).reshape(args.batch, t)
                    started = time.perf_counter()
                    # Two warm-up steps: torch.compile may compile again at
                    # the second call (new guards), and the first timed
                    # step would pay for it.
                    for _ in range(2):
                        step(model, opt, tokens, precision)
                    sync(device)
                    row["first_step_s"] = time.perf_counter() - started
                    started = time.perf_counter()
                    for _ in range(args.steps):
                        loss = step(model, opt, tokens, precision)
                    sync(device)
                    row["tokens_per_s"] = args.steps * args.batch * t / (time.perf_counter() - started)
                    row["loss"] = loss.item()
                    if device.type == "cuda":
                        row["device_memory_bytes"] = torch.cuda.max_memory_allocated()
                except torch.OutOfMemoryError:
                    row["skipped"] = "out of memory"
                except Exception as e:  # noqa: BLE001 (one row fails, the others go on)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                finally:
                    model = opt = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    shown = f"{row['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in row else row.get("skipped", row.get("error"))
                    print(f"{impl:<9} T={t:<7} {precision:<5} {shown}", flush=True)


def products(args):
    """Times each product of `tvq bench products --json`'s lines (FILE, or
    stdin) with torch.matmul at the same shape, pass and precision: a batch
    of [m, k] x [k, n] (pass forward), [m, n] x [n, k] with the right
    operand a transposed view (grad_left, as autograd's dA = dC B^T) or
    [k, m] x [m, n] with the left one transposed (grad_right, dB = A^T dC);
    one untimed, then rounds of doubling length until a round lasts 0.1 s.
    f32 is timed twice on CUDA, in f32 and with TF32 allowed (what tvq's
    f32 products are there); bf16 is bf16 operands."""
    device = torch.device(args.device)
    source = open(args.source) if args.source != "-" else sys.stdin
    rows = [json.loads(l) for l in source if l.startswith("{")]
    rows = [r for r in rows if r.get("form") == "products" and "flops_per_s" in r]
    for r in rows:
        kinds = [("torch", False)]
        if r["precision"] == "f32" and device.type == "cuda":
            kinds.append(("torch-tf32", True))
        for impl, tf32 in kinds:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[r["precision"]]
            batch, m, k, n = r["batch"], r["m"], r["k"], r["n"]
            pass_ = r.get("pass", "forward")
            randn = lambda *shape: torch.randn(batch, *shape, device=device).to(dtype)
            if pass_ == "forward":
                a, b = randn(m, k), randn(k, n)
            elif pass_ == "grad_left":
                a, b = randn(m, n), randn(k, n).transpose(1, 2)
            else:
                a, b = randn(m, k).transpose(1, 2), randn(m, n)
            torch.matmul(a, b)
            sync(device)
            rounds = 1
            while True:
                started = time.perf_counter()
                for _ in range(rounds):
                    torch.matmul(a, b)
                sync(device)
                seconds = time.perf_counter() - started
                if seconds >= 0.1:
                    break
                rounds *= 2
            row = {key: r[key] for key in ("attention", "seq_len", "rows", "precision", "name", "count",
                                           "batch", "m", "k", "n", "flops")}
            row.update(form="products", impl=impl, **{"pass": pass_}, flops_per_s=rounds * r["flops"] / seconds,
                       tvq_flops_per_s=r["flops_per_s"], torch=torch.__version__,
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
            a = b = None
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{row['name']:<32} {pass_:<10} T={row['seq_len']:<7} {row['precision']:<5} {impl:<10} "
                      f"{row['flops_per_s'] / 1e9:,.1f} GFLOP/s (tvq {r['flops_per_s'] / 1e9:,.1f})", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("eval", help="the loss of a tvq export on a byte-level text file's split")
    e.add_argument("--export", required=True, help="FILE.safetensors written by tvq export")
    e.add_argument("--text", required=True, help="the byte-level text file (e.g. data/kjv.txt)")
    e.add_argument("--split", default="validation", choices=["train", "validation", "test"])
    e.add_argument("--batch-size", type=int, default=16, help="rows (tvq's eval.batch_size)")
    e.add_argument("--update-len", type=int, default=1024, help="segment (tvq's eval.update_len)")
    e.add_argument("--max-segments", type=int, help="score only the first segments")
    b = sub.add_parser("bench", help="training-step throughput: eager, compiled, SDPA quadratic")
    b.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    b.add_argument("--seq-len", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048],
                   help="segment lengths, comma separated")
    b.add_argument("--precision", type=lambda s: s.split(","), default=None,
                   help="f32, bf16 (autocast), comma separated (default: both on CUDA, f32 on the CPU)")
    b.add_argument("--impl", type=lambda s: s.split(","), default=["eager", "compiled", "sdpa"],
                   help="eager, compiled (torch.compile), sdpa (the quadratic baseline)")
    b.add_argument("--widths", default="enwik8", choices=["enwik8", "bench"],
                   help="the enwik8 config's widths, or tvq bench's default model")
    b.add_argument("--layers", type=int, default=None, help="layers (default: 4 for enwik8, 2 for bench)")
    b.add_argument("--small", action="store_true", help="a tiny model instead")
    b.add_argument("--batch", type=int, default=1, help="rows per step")
    b.add_argument("--steps", type=int, default=2, help="timed steps after two warm-up steps")
    b.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    b.add_argument("--json", action="store_true", help="one JSON object per row")
    m = sub.add_parser("products", help="the matrix products of `tvq bench products --json`, in PyTorch")
    m.add_argument("--from", dest="source", default="-", help="tvq's JSON lines (default: stdin)")
    m.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    m.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    m.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args()
    if args.command == "products":
        if args.threads:
            torch.set_num_threads(args.threads)
        products(args)
    elif args.command == "eval":
        torch.set_grad_enabled(False)
        model, info = load_export(args.export)
        loss, tokens = evaluate(model, split_tokens(args.text, args.split), args.batch_size,
                                args.update_len, args.max_segments)
        print(json.dumps({"loss": loss, "tokens": tokens, "bits_per_byte": loss / math.log(2)}))
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.layers is None:
            args.layers = 4 if args.widths == "enwik8" else 2
        if args.precision is None:
            args.precision = ["f32", "bf16"] if args.device.startswith("cuda") else ["f32"]
        bench(args)


if __name__ == "__main__":
    sys.exit(main())
