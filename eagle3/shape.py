"""The drafter's shape: its widths and options, read from and written to the export's config.json
(`DrafterShape`), or derived from the target's (`drafter_shape`). eagle3/model.py builds the
network of a shape; docs/design.md gives the export format.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DrafterShape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int                 # target vocab V (the shared embedding's rows)
    draft_vocab_size: int           # Vd (lm_head rows)
    target_hidden_size: int         # Ht (width of each aux state)
    num_aux: int = 3                # k
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    fc_norm: bool = False           # EAGLE-3.1: an RMSNorm [Ht] on each aux state before fc
    norm_output: bool = False       # EAGLE-3.1: the next step reads norm(h_out), not h_out
    num_layers: int = 1             # decoder layers: the EAGLE-3 layer, then num_layers-1 Llama layers

    def to_hf_config(self) -> dict:
        """The Llama fields of the export's config.json. The exporter adds `architectures`,
        `eagle_config` (engine aux ids) and dtype."""
        return {
            "model_type": "llama", "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": self.num_aux,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False,
            "fc_norm": self.fc_norm, "norm_output": self.norm_output,
        }

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "DrafterShape":
        """The shape of an exported drafter (config.json as a dict)."""
        rope = cfg.get("rope_parameters") or {}
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        # variants the engines know and this drafter does not compute: refuse rather than run
        # a different network than the one exported
        other = [k for k in _UNSUPPORTED if cfg.get(k) or eagle.get(k)]
        if other:
            raise ValueError(f"drafter config sets {other}: not implemented by eagle3.model")
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            num_aux=cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            hidden_act=cfg.get("hidden_act", "silu"),
            fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")),
            norm_output=bool(cfg.get("norm_output")),
            num_layers=int(cfg.get("num_hidden_layers", 1)))

    def num_trainable(self) -> int:
        """Trainable parameter count (everything but the shared embedding)."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d   # per H inputs
        rest = self.num_attention_heads * d * h + 3 * h * self.intermediate_size
        layers = 2 * qkv + rest + 3 * h + (self.num_layers - 1) * (qkv + rest + 2 * h)
        fc_norm = self.num_aux * self.target_hidden_size if self.fc_norm else 0
        return self.num_aux * self.target_hidden_size * h + fc_norm + layers + h + h * self.draft_vocab_size


# Engine options of LlamaForCausalLMEagle3 that change the network and are not built here.
_UNSUPPORTED = ("norm_before_fc", "norm_before_residual")

# Attention that is not a Llama layer (DeepSeek's MLA): its head_dim says nothing about a Llama drafter's.
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def drafter_shape(target, cfg, num_aux: int, draft_vocab_size: int) -> DrafterShape:
    """The drafter's shape: values given in `cfg` (eagle3.config.DrafterConfig; 0 = derive), the
    rest from `target` (eagle3.targets.TargetInfo): cfg.num_layers decoder layers shaped like the
    target's. The hidden size must be the target's: the drafter embeds with the target's own table."""
    if cfg.num_layers < 1:
        raise ValueError(f"drafter.num_layers={cfg.num_layers}: a drafter has at least one layer")
    if cfg.hidden_size and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"drafter.hidden_size={cfg.hidden_size} but the target's is "
                         f"{target.hidden_size}: the drafter shares the target's embedding")
    heads = cfg.num_attention_heads or target.num_attention_heads
    mla = target.model_type in _MLA_TYPES
    same_heads = heads == target.num_attention_heads
    kv_heads = cfg.num_key_value_heads or (target.num_key_value_heads if same_heads and not mla
                                           else heads)
    head_dim = cfg.head_dim or (target.head_dim if same_heads and not mla
                                else target.hidden_size // heads)
    return DrafterShape(
        hidden_size=target.hidden_size,
        intermediate_size=cfg.intermediate_size or target.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
        target_hidden_size=target.hidden_size, num_aux=num_aux,
        rms_norm_eps=cfg.rms_norm_eps or target.rms_norm_eps,
        rope_theta=cfg.rope_theta or target.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings or target.max_position_embeddings or 4096,
        fc_norm=cfg.fc_norm, norm_output=cfg.norm_output, num_layers=cfg.num_layers)
