"""hpcrl export: a committed role as a Hugging Face folder, from the torch engine's state and from
megatron-core's shards of any TP × PP layout (written here as megatron's role file holds them)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

from hpcrl.checkpoint.export import export_role
from hpcrl.checkpoint.format import write_role_file
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.engines.train.megatron_layout import to_megatron
from hpcrl.models import CharTokenizer, ValueModel
from hpcrl.models.shape import Shape


def model_dir(tmp_path, tied=False):
    cfg = Qwen2Config(vocab_size=61, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "model")
    CharTokenizer("".join(chr(65 + i) for i in range(58))).save(tmp_path / "model")
    return tmp_path / "model"


def commit(tmp_path, role, state, step=7):
    store = CheckpointStore(tmp_path / "run")
    path = store.role_path(step, role)
    files = {role: {"path": str(path.relative_to(store.root)), **write_role_file(path, {"role": state}, {"step": step})}}
    store.commit(step, files, {"step": step})
    return store


def megatron_state(hf: dict, shape: Shape, tp: int, pp: int, dp: int, value_head=False) -> dict:
    """A megatron role file's state: every rank's shard, rank = tp_rank + tp * (dp_rank + dp * pp_rank)."""
    ranks = {}
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                ranks[t + tp * (d + dp * p)] = {"model": to_megatron(hf, shape, tp, t, pp, p, value_head=value_head),
                                                "coords": [p, t]}
    return {"layout": {"tensor_parallel": tp, "pipeline_parallel": pp, "world_size": tp * pp * dp}, "ranks": ranks}


def trained(model_dir):
    """The model with every weight moved, as training would have."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model.state_dict()


@pytest.mark.parametrize("engine,tp,pp", [("torch", 1, 1), ("megatron", 2, 1), ("megatron", 2, 2), ("megatron", 1, 2)])
def test_the_export_holds_the_committed_weights(tmp_path, engine, tp, pp):
    src = model_dir(tmp_path, tied=pp == 2 and tp == 1)
    weights = trained(src)
    state = {"model": weights} if engine == "torch" else megatron_state(weights, Shape.of(
        AutoModelForCausalLM.from_pretrained(src).config), tp, pp, dp=2)
    store = commit(tmp_path, "actor_rollout", state)
    out = export_role(store, "actor_rollout", src, tmp_path / "out", dtype="fp32")
    got = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert got.dtype == torch.float32
    for name, tensor in weights.items():
        assert torch.equal(got.state_dict()[name], tensor), name
    assert (out / "hpcrl_tokenizer.json").exists() and (out / "generation_config.json").exists()
    bf16 = export_role(store, "actor_rollout", src, tmp_path / "bf16", dtype="bf16")
    assert AutoModelForCausalLM.from_pretrained(bf16, local_files_only=True).dtype == torch.bfloat16


def test_the_critic_exports_as_a_token_classifier_of_its_values(tmp_path):
    src = model_dir(tmp_path)
    values = ValueModel(src)
    with torch.no_grad():
        values.head.weight.normal_()
        values.head.bias.fill_(0.25)
    store = commit(tmp_path, "critic", megatron_state(values.state_dict(), Shape.of(values.backbone.config), 2, 1, 1,
                                                      value_head=True))
    out = export_role(store, "critic", src, tmp_path / "critic", dtype="fp32")
    exported = AutoModelForTokenClassification.from_pretrained(out, local_files_only=True).eval()
    x = torch.randint(3, 61, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=x).logits[..., 0], values.eval()(x, torch.ones_like(x)))
        again = ValueModel(out).eval()           # critic_init from an exported critic keeps its head
        torch.testing.assert_close(again(x, torch.ones_like(x)), values(x, torch.ones_like(x)))


def test_export_names_what_is_missing(tmp_path):
    src = model_dir(tmp_path)
    store = commit(tmp_path, "actor_rollout", {"model": trained(src)})
    with pytest.raises(ValueError, match=r"step 7 has no role 'critic' \(it has: actor_rollout\)"):
        export_role(store, "critic", src, tmp_path / "x")
    with pytest.raises(ValueError, match=r"no committed step 3 \(committed: \[7\]\)"):
        export_role(store, "actor_rollout", src, tmp_path / "x", step=3)
