"""Reading a run's checkpoint (eagle3/checkpoint.py) from the layouts its writers leave: a
hand-built DeepSpeed checkpoint directory, with its state dict known in advance.
"""
import pytest
import torch

from eagle3 import checkpoint


def test_checkpoint_weights_are_read_from_deepspeed_layouts(tmp_path):
    """DeepSpeed writes its own files under <checkpoint>/pytorch_model/: the module states
    (mp_rank_00_model_states.pt, whole weights) under ZeRO-1/2, and per-rank partitions under ZeRO-3,
    which the export cannot read alone: its error names the resume that exports it."""
    sd = {"drafter.fc.weight": torch.randn(4, 6), "drafter.norm.weight": torch.ones(4)}
    ck = tmp_path / "step_0000003"
    (ck / "pytorch_model").mkdir(parents=True)
    (ck / "trainer_state.json").write_text('{"step": 3}\n')
    torch.save({"module": sd, "ds_config": {"zero_optimization": {"stage": 2}}},
               ck / "pytorch_model" / "mp_rank_00_model_states.pt")
    got = checkpoint.load_model_state(ck)
    assert sorted(got) == sorted(sd) and all(torch.equal(got[k], sd[k]) for k in sd)

    (ck / "pytorch_model" / "mp_rank_00_model_states.pt").unlink()
    (ck / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="resume=true train.steps=3"):
        checkpoint.load_model_state(ck)
