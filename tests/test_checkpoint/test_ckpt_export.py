import pytest
import torch
from safetensors.torch import load_file

from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointManager, export_best, export_model, load_model
from trainer.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3)
        self.register_buffer("offset", torch.zeros(3))

    def forward(self, x):
        return self.head(self.norm(self.body(x))) + self.offset


def _train_and_save(tmp_path, lower_better=True):
    torch.manual_seed(0)
    model = _Net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    mgr = CheckpointManager(tmp_path, setup_gangs(FakeGang()), lower_better=lower_better)
    outputs = {}
    x = torch.randn(7, 4)
    for step, score in zip((1, 2, 3), (0.5, 0.2, 0.9)):
        optim.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        optim.step()
        with torch.no_grad():
            model.offset.add_(step)
            outputs[step] = model(x)
        mgr.save(step, model, optim, {"step": step})
        mgr.record_score(step, score)
    mgr.close()
    return x, outputs


def test_best_model_loads_weights_only_and_gives_identical_outputs(tmp_path):
    x, outputs = _train_and_save(tmp_path)
    path = export_best(tmp_path)
    assert path == tmp_path / "best_model.safetensors"
    state = load_file(path)
    assert set(state) == set(_Net().state_dict())  # full names, no optimizer entries
    fresh = _Net()
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(x), outputs[2])  # step 2 has the lowest score


def test_best_follows_the_recorded_direction(tmp_path):
    x, outputs = _train_and_save(tmp_path, lower_better=False)
    fresh = _Net()
    fresh.load_state_dict(load_file(export_best(tmp_path)))
    with torch.no_grad():
        assert torch.equal(fresh(x), outputs[3])


def test_export_latest_and_load_model(tmp_path):
    x, outputs = _train_and_save(tmp_path)
    state = torch.load(export_model(tmp_path, tmp_path / "out" / "m.pt"), weights_only=True)
    fresh = _Net()
    fresh.load_state_dict(state)
    loaded = load_model(tmp_path / "step_1", _Net())
    with torch.no_grad():
        assert torch.equal(fresh(x), outputs[3])
        assert torch.equal(loaded(x), outputs[1])


def test_export_refuses_damaged_or_missing(tmp_path):
    assert export_best(tmp_path) is None
    with pytest.raises(UserError, match="no complete checkpoint"):
        export_model(tmp_path, tmp_path / "m.pt")
    _train_and_save(tmp_path)
    (tmp_path / "step_2" / "rank_0.pt").write_bytes(b"")
    with pytest.raises(UserError, match="step_2 cannot be loaded: rank_0.pt has 0 bytes"):
        export_best(tmp_path)
    wider = _Net()
    wider.head = torch.nn.Linear(8, 4)
    with pytest.raises(UserError, match=r"'head.weight' has shape \(3, 8\) in the checkpoint"):
        load_model(tmp_path / "step_1", wider)
