"""The DSpark drafter (docs/architecture.md §5): a DFlash-style parallel backbone on projected target taps,
a sequential head (Markov / RNN / none) sampled left to right, and a confidence head.

Context (per slot): H_ctx = RMSNorm(W_c [taps]) of every token in the target's KV cache;
each backbone layer keeps the K/V of H_ctx (its own k/v projections), extended with the taps
of every accepted token. Block: inputs [emb(x0), m, …, m] (m = learned mask embedding) at
positions L, …, L+G−1 (L = context length, G = trained block size); queries from the block,
keys/values [ctx ; block], non-causal inside the block. Output h_k at block index k−1
predicts the token at anchor+k; U_k = lm_head(norm(h_k)).

γ at propose time: the backbone always runs the trained block of G inputs (so h_k is
exactly what training saw) and the first γ ≤ G outputs are sampled; one drafter trained
with G = 15 serves γ = 7 and γ = 15.

Embedding and LM head are the target's, frozen and shared (never stored with the drafter)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.runtime.drafter.context import SlotDrafter
from dspark.runtime.drafter.heads import ConfidenceHead, make_head
from dspark.runtime.interfaces import DraftBlock
from dspark.runtime.model import RMSNorm, apply_rope, rope_cos_sin
from dspark.runtime.sampling import SamplingParams, param_tensors, sample, sampling_probs


class JsonConfig:
    """config.json round trip for drafter config dataclasses; unknown keys are ignored."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class DSparkConfig(JsonConfig):
    vocab_size: int
    hidden_size: int  # = the target's (shared embedding / LM head)
    tap_dim: int  # n_taps * target hidden
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 15  # G: trained block, the largest γ
    gamma: int = 7  # default γ at propose time
    head: str = "markov"  # markov | rnn | none
    head_rank: int = 64
    tap_layers: list[int] | None = None  # the target layers the taps come from (checked at load)
    kind: str = "dspark"


def rope_inv_freq_plain(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads externally supplied context K/V."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> k, v [B, T, Hkv, hd] (k normed and rotated). Used for ctx and block alike."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim))
        return apply_rope(k, cos, sin), self.v_proj(x).view(b, t, self.n_kv, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, d] block stream; ctx_k/v [B, C, Hkv, hd]; mask [B, Q, C+Q] bool (True = attend)."""
        b, q_len, _ = x.shape
        h = self.input_norm(x)
        q = apply_rope(self.q_norm(self.q_proj(h).view(b, q_len, self.n_heads, self.head_dim)), cos, sin)
        k, v = self.kv(h, cos, sin)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                             enable_gqa=self.n_heads != self.n_kv)
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DSparkModel(nn.Module):
    """Trainable parameters of the drafter. The target's embedding / LM-head weights are
    attached with `attach_shared` as plain tensors (not parameters: frozen, not saved)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        if not 1 <= cfg.gamma <= cfg.block_size:
            raise ValueError(f"gamma {cfg.gamma} must be in [1, block_size={cfg.block_size}]")
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.tap_dim, d, bias=False)  # W_c
        self.ctx_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = make_head(cfg.head, cfg.vocab_size, d, cfg.head_rank)
        self.conf = ConfidenceHead(d, cfg.head_rank)
        self.register_buffer("inv_freq", rope_inv_freq_plain(cfg.head_dim, cfg.rope_theta), persistent=False)
        for m in [self.fc, *self.layers]:
            for p in m.modules():
                if isinstance(p, nn.Linear):
                    nn.init.normal_(p.weight, std=0.02)
        self.embed_weight: torch.Tensor | None = None
        self.lm_head_weight: torch.Tensor | None = None

    def attach_shared(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self.embed_weight, self.lm_head_weight = embed_weight.detach(), lm_head_weight.detach()

    def init_from_target(self, embed_weight: torch.Tensor, norm_weight: torch.Tensor,
                         mask_token_id: int | None = None) -> None:
        """Start the mask embedding at the target's <|mask|> row (or the mean row) and the final
        norm at the target's final norm, so U_k starts in the target's logit scale."""
        with torch.no_grad():
            row = embed_weight[mask_token_id] if mask_token_id is not None else embed_weight.mean(0)
            self.mask_embedding.copy_(row.float())
            self.norm.weight.copy_(norm_weight.float())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed_weight).to(self.fc.weight.dtype)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """U = lm_head(norm(h)) with the target's LM-head weight."""
        return F.linear(self.norm(h), self.lm_head_weight.to(h.dtype))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """taps [B, L, tap_dim] at positions [B, L] -> per layer (k, v) [B, L, Hkv, hd]."""
        h_ctx = self.ctx_norm(self.fc(taps.to(self.fc.weight.dtype)))
        cos, sin = self.rope(positions, h_ctx.dtype)
        return [layer.kv(h_ctx, cos, sin) for layer in self.layers]

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, mask: torch.Tensor) -> torch.Tensor:
        """Block stream x [B, Q, d] at positions [B, Q]; mask [B, Q, C+Q] -> h [B, Q, d]."""
        cos, sin = self.rope(positions, x.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, mask)
        return x

    def block_inputs(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [...] -> [..., G, d]: emb(x0) then the mask embedding G−1 times."""
        g = self.config.block_size
        first = self.embed(anchors)[..., None, :]
        rest = self.mask_embedding.expand(*anchors.shape, g - 1, -1)
        return torch.cat([first, rest.to(first.dtype)], dim=-2)

    def train_hidden(self, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Many blocks per sequence in one pass (training). tokens [B, T], taps [B, T, tap_dim]
        (taps of token t at row t), anchors [B, nb] positions a (the block's context is the taps
        of tokens 0..a−1) -> h [B, nb, G, d]. Equals running each block alone at inference."""
        b, t = tokens.shape
        nb, g = anchors.shape[1], self.config.block_size
        ctx_kv = self.context_kv(taps, torch.arange(t, device=tokens.device).expand(b, t))
        x = self.block_inputs(tokens.gather(1, anchors)).reshape(b, nb * g, -1)
        offs = torch.arange(g, device=tokens.device)
        positions = (anchors[..., None] + offs).reshape(b, nb * g)
        q_anchor = anchors[..., None].expand(b, nb, g).reshape(b, nb * g)
        ctx_mask = torch.arange(t, device=tokens.device)[None, None, :] < q_anchor[..., None]
        block_id = torch.arange(nb, device=tokens.device).repeat_interleave(g)
        blk_mask = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
        h = self.backbone(x, positions, ctx_kv, torch.cat([ctx_mask, blk_mask], dim=-1))
        return h.view(b, nb, g, -1)

    def trainable_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class DSparkDrafter(SlotDrafter):
    """`DrafterLike` runtime over a `DSparkModel`: per-slot context K/V, batched propose."""

    kind = "dspark"

    # --- per-slot context ---
    def start(self, slot: int, prompt: list[int], taps: torch.Tensor) -> None:
        if taps.shape[0] != len(prompt):
            raise ValueError(f"start: {len(prompt)} prompt tokens but {taps.shape[0]} taps rows")
        self.ctx.start(slot)
        self._append(slot, taps)

    def extend(self, slots: list[int], tokens: list[torch.Tensor], taps: list[torch.Tensor]) -> None:
        for slot, tok, tp in zip(slots, tokens, taps, strict=True):
            if tp.shape[0] != tok.shape[0]:
                raise ValueError(f"extend slot {slot}: {tok.shape[0]} tokens but {tp.shape[0]} taps rows")
            self._append(slot, tp)

    def context_length(self, slot: int) -> int:
        return self.ctx.length(slot, "k0")

    @torch.inference_mode()
    def _append(self, slot: int, taps: torch.Tensor) -> None:
        if taps.shape[0] == 0:
            return
        start = self.context_length(slot)
        pos = torch.arange(start, start + taps.shape[0], device=self.device)[None]
        for i, (k, v) in enumerate(self.model.context_kv(taps.to(self.device)[None], pos)):
            self.ctx.append(slot, f"k{i}", k[0])
            self.ctx.append(slot, f"v{i}", v[0])

    # --- drafting ---
    def _block(self, slots: list[int], anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Backbone over the trained block for each slot -> h [R, γ, d], U [R, γ, V] f32."""
        m, cfg = self.model, self.config
        r, g = len(slots), self.block_size
        like = torch.zeros(1, cfg.num_kv_heads, cfg.head_dim, device=self.device, dtype=m.fc.weight.dtype)
        ctx_kv, valid = [], None
        for i in range(cfg.num_layers):
            k, valid = self.ctx.padded(slots, f"k{i}", like)
            v, _ = self.ctx.padded(slots, f"v{i}", like)
            ctx_kv.append((k, v))
        positions = valid.sum(1)[:, None] + torch.arange(g, device=self.device)
        mask = torch.cat([valid[:, None, :].expand(r, g, -1),
                          torch.ones(r, g, g, dtype=torch.bool, device=self.device)], dim=-1)
        h = m.backbone(m.block_inputs(anchors), positions, ctx_kv, mask)[:, :self.gamma]
        return h, m.lm_head(h).float()

    def _step(self, h_k: torch.Tensor, base_k: torch.Tensor, x_prev: torch.Tensor, state):
        """Position k: (logits U_k + B_k(x_{k−1}) [R, V], conf logit z_k [R], head state)."""
        m = self.model
        feats, state = m.head.step(x_prev, h_k, state)
        logits = base_k if feats is None else base_k + m.head.bias(feats).float()
        return logits, m.conf(h_k, m.head.token_features(x_prev)).float(), state

    @torch.inference_mode()
    def propose(self, slots: list[int], anchors: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> DraftBlock:
        anchors = anchors.to(self.device, torch.int64)
        h, base = self._block(slots, anchors)
        r, gamma = len(slots), self.gamma
        temp, top_k, top_p = param_tensors(params, self.device)
        greedy = [p.greedy for p in params]
        tokens = torch.empty(r, gamma, dtype=torch.int64, device=self.device)
        probs = torch.empty(r, gamma, self.config.vocab_size, device=self.device)
        conf = torch.empty(r, gamma, device=self.device)
        x_prev, state = anchors, None
        for k in range(gamma):
            logits, conf[:, k], state = self._step(h[:, k], base[:, k], x_prev, state)
            probs[:, k] = sampling_probs(logits, temp, top_k, top_p)
            tokens[:, k] = draw_tokens(probs[:, k], logits, greedy, generators)
            x_prev = tokens[:, k]
        return DraftBlock(tokens.cpu(), probs.cpu(), conf.cpu())

    @torch.inference_mode()
    def score(self, slots: list[int], anchors: torch.Tensor,
              tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced: the logits [R, γ, V] and confidence logits [R, γ] the drafter would
        use at each position if it had drafted `tokens` [R, γ] (tests, analysis)."""
        anchors, tokens = anchors.to(self.device, torch.int64), tokens.to(self.device, torch.int64)
        h, base = self._block(slots, anchors)
        x_prev, state, out, conf = anchors, None, [], []
        for k in range(self.gamma):
            logits, z, state = self._step(h[:, k], base[:, k], x_prev, state)
            out.append(logits)
            conf.append(z)
            x_prev = tokens[:, k]
        return torch.stack(out, 1).cpu(), torch.stack(conf, 1).cpu()

    # --- persistence ---
    def save(self, folder: str | Path) -> Path:
        return save_dspark(self.model, folder)


def draw_tokens(probs: torch.Tensor, logits: torch.Tensor, greedy: list[bool],
          generators: list[torch.Generator | None]) -> torch.Tensor:
    """Greedy rows: argmax (= sampling_probs' one-hot); others: one draw from their own generator."""
    out = logits.argmax(-1)
    rows = [i for i, gr in enumerate(greedy) if not gr]
    if rows:
        drawn = sample(probs[rows].cpu(), [generators[i] for i in rows]).to(out.device)
        out[rows] = drawn
    return out


def save_dspark(model: DSparkModel, folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """config.json + model.safetensors (trainable weights only, stored as `dtype`; the shared
    embedding / LM head come from the target at load time). Leaves calibration.json alone."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def read_calibration(folder: str | Path | None) -> list[float] | None:
    """STS temperatures written by `dspark calibrate` (calibration.json "sts_temperatures");
    None when the folder (or the file) is absent."""
    if folder is None:
        return None
    path = Path(folder) / "calibration.json"
    if not path.is_file():
        return None
    temps = json.loads(path.read_text()).get("sts_temperatures")
    return None if temps is None else [float(t) for t in temps]


def shared_weights(target) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding [V, d], LM head [V, d], final norm [d]) of a TargetEngine or a Transformer."""
    model = getattr(target, "model", target)
    lm = model.embed_tokens.weight if model.lm_head_proj is None else model.lm_head_proj.weight
    return model.embed_tokens.weight, lm, model.norm.weight


def load_dspark(folder: str | Path, target, gamma: int | None = None) -> DSparkDrafter:
    folder = Path(folder)
    cfg = DSparkConfig.from_json(json.loads((folder / "config.json").read_text()))
    embed, lm_head, _ = shared_weights(target)
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"drafter {folder} expects embedding {(cfg.vocab_size, cfg.hidden_size)}, "
                         f"target has {tuple(embed.shape)}")
    tap_layers = getattr(target, "tap_layers", None)
    if cfg.tap_layers is not None and tap_layers is not None and list(tap_layers) != list(cfg.tap_layers):
        raise ValueError(f"drafter {folder} was trained on taps {cfg.tap_layers}, target gives {tap_layers}")
    model = DSparkModel(cfg)
    model.load_state_dict({k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()})
    model.to(embed.device)
    return DSparkDrafter(model, embed, lm_head, gamma=gamma, sts_temperatures=read_calibration(folder))
