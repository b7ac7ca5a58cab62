"""Delta weight sync: the per-tensor encodings on hand-checked bytes, the payload format's checks, and an
InProcessEngine kept byte-identical to a trainer through 50 Muon and AdamW steps on fp32 and bf16 weights;
wrong bases, corrupted payloads and diverged receivers are refused with the weights unchanged."""
import numpy as np
import pytest
import torch
import zstandard

from hf_reference import small_config
from orthon.core.errors import CheckpointError
from orthon.engine import InProcessEngine, WeightDelta
from orthon.engine.delta import DeltaEncoder, DeltaPayload
from orthon.engine.delta_codec import (ENCODINGS, apply_encoded, encode_tensor, gap_tokens, positions_from_gaps,
                                       to_planes, from_planes, unzigzag, zigzag)
from orthon.engine.tensor_bytes import int_view, tensor_hashes
from orthon.optim import OptimConfig, ScheduleConfig, build_for_model
from orthon.pretrain import GLMForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")

ZSTD = zstandard.ZstdCompressor(level=1)
SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(SIGNED[t.element_size()])


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_ints(a), as_ints(b))


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_holds(model, expected: dict[str, torch.Tensor]):
    state = model.state_dict()
    assert set(state) == set(expected)
    wrong = [k for k in expected if not same_bytes(state[k], expected[k])]
    assert not wrong, f"tensors differ: {wrong[:5]}"


# ---------------------------------------------------------------- building blocks, by hand
def test_gap_tokens_by_hand():
    # first gap counts from -1; a gap >= 65535 becomes escapes (65535 each) plus the remainder
    assert gap_tokens(np.array([0, 70000])).tolist() == [1, 65535, 70000 - 65535]
    assert gap_tokens(np.array([65534])).tolist() == [65535, 0]  # gap exactly 65535: escape, then 0
    assert gap_tokens(np.array([3, 4, 200000])).tolist() == [4, 1, 65535, 65535, 65535, 200000 - 4 - 3 * 65535]
    for positions in ([0, 70000], [65534], [3, 4, 200000], [], [2**33]):
        assert positions_from_gaps(gap_tokens(np.array(positions, np.int64))).tolist() == positions


def test_zigzag_and_planes_by_hand():
    diffs = np.array([0, 1, 65535, 2, 65534], np.uint16)  # 0, 1, -1, 2, -2
    assert zigzag(diffs).tolist() == [0, 2, 1, 4, 3]
    assert unzigzag(zigzag(diffs)).tolist() == diffs.tolist()
    assert to_planes(np.array([0x0102, 0x0304], np.uint16)).tolist() == [0x02, 0x04, 0x01, 0x03]
    wide = np.array([0x01020304, 0xA0B0C0D0], np.uint32)
    assert to_planes(wide).tolist() == [0x04, 0xD0, 0x03, 0xC0, 0x02, 0xB0, 0x01, 0xA0]
    assert from_planes(to_planes(wide), np.uint32).tolist() == wide.tolist()


def test_raw_encodings_by_hand():
    old = torch.zeros(10, dtype=torch.bfloat16)
    new = old.clone()
    new[5] = 1.0  # bf16 1.0 is 0x3F80
    ints = (int_view(old), int_view(new))
    assert encode_tensor(*ints, ZSTD, ("int32_positions",)).blob == b"\x05\x00\x00\x00" + b"\x80\x3f"
    assert encode_tensor(*ints, ZSTD, ("uint16_gaps",)).blob == b"\x06\x00" + b"\x80\x3f"
    assert encode_tensor(*ints, ZSTD, ("full",)).blob == bytes(10) + b"\x80\x3f" + bytes(8)
    chosen = encode_tensor(*ints, ZSTD)
    assert (chosen.encoding, chosen.blob, chosen.changed) == ("uint16_gaps", b"\x06\x00\x80\x3f", 1)
    big_old = torch.zeros(70001, dtype=torch.float32)
    big_new = big_old.clone()
    big_new[[0, 70000]] = 2.0  # fp32 2.0 is 0x40000000
    tokens = np.array([1, 65535, 4465], "<u2").tobytes()
    blob = encode_tensor(int_view(big_old), int_view(big_new), ZSTD, ("uint16_gaps",)).blob
    assert blob == tokens + b"\x00\x00\x00\x40" * 2


CASES = {
    "no change": lambda t: t.clone(),
    "first": lambda t: _set(t, [0]),
    "last": lambda t: _set(t, [t.numel() - 1]),
    "gap over 65535": lambda t: _set(t, [1, 1 + 65535, 1 + 65535 + 70000, t.numel() - 1]),
    "every element": lambda t: _set(t, list(range(t.numel()))),
    "half": lambda t: _set(t, list(range(0, t.numel(), 2))),
}


def _set(t, positions):
    out = t.clone()
    flat = as_ints(out).view(-1)
    flat[positions] += 1  # the next representable value (or the next integer)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.int64])
def test_every_encoding_round_trips_the_hand_made_cases(dtype):
    torch.manual_seed(1)
    old = (torch.randn(140000) * 20).to(dtype)
    for case, make in CASES.items():
        new = make(old)
        changed = int((as_ints(old) != as_ints(new)).sum())
        for encoding in ENCODINGS:
            encoded = encode_tensor(int_view(old), int_view(new), ZSTD, (encoding,))
            if changed == 0:
                assert encoded is None
                continue
            assert encoded.encoding == encoding and encoded.changed == changed, case
            target = old.clone()
            apply_encoded(encoded.encoding, encoded.blob, int_view(target), encoded.changed)
            assert same_bytes(target, new), (case, encoding)
        if changed:
            chosen = encode_tensor(int_view(old), int_view(new), ZSTD)
            raw = [len(encode_tensor(int_view(old), int_view(new), ZSTD, (e,)).blob)
                   for e in ("full", "int32_positions", "uint16_gaps")]
            assert len(chosen.blob) <= min(raw), case  # the chooser never loses to an uncompressed form


def test_special_float_bytes_sync_exactly():
    old = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1.0, -1.0] * 1000)
    new = old.clone()
    as_ints(new)[::7] ^= 0x1  # a NaN with another payload, denormals, ... compared as bytes
    new[1] = 0.0  # -0.0 -> +0.0: equal as floats, different bytes
    for encoding in ENCODINGS:
        encoded = encode_tensor(int_view(old), int_view(new), ZSTD, (encoding,))
        target = old.clone()
        apply_encoded(encoded.encoding, encoded.blob, int_view(target), encoded.changed)
        assert same_bytes(target, new), encoding


def test_a_blob_that_does_not_fit_its_tensor_is_refused():
    old, new = torch.zeros(100), torch.ones(100)
    for encoding in ENCODINGS:
        encoded = encode_tensor(int_view(old), int_view(new), ZSTD, (encoding,))
        target = torch.zeros(50)
        with pytest.raises(CheckpointError):
            apply_encoded(encoding, encoded.blob, int_view(target), encoded.changed)
        assert torch.equal(target, torch.zeros(50))
    with pytest.raises(CheckpointError, match="not one of"):
        apply_encoded("lz4", b"", int_view(torch.zeros(3)), 1)


# ---------------------------------------------------------------- the payload
def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "h": torch.randn(300, generator=g).bfloat16(),
            "steps": torch.arange(5)}


def _changed(state):
    new = {k: v.clone() for k, v in state.items()}
    new["w"][3, :7] += 0.25
    new["h"][::3] *= 1.5
    return new


def test_payload_round_trips_through_bytes_and_applies_in_place():
    base, new = _state(), None
    encoder = DeltaEncoder()
    encoder.reset(base, version=4)
    new = _changed(base)
    payload = encoder.encode(new, version=5)
    assert isinstance(payload, WeightDelta)
    assert (payload.base_version, payload.version) == (4, 5)
    assert payload.names == ["w", "h"]  # "steps" did not change: not sent
    data = payload.to_bytes()
    assert len(data) == payload.nbytes
    received = DeltaPayload.from_bytes(data)
    assert (received.base_version, received.version, received.names) == (4, 5, ["w", "h"])
    assert received.to_bytes() == data
    target = {k: v.clone() for k, v in base.items()}
    pointers = {k: v.data_ptr() for k, v in target.items()}
    assert received.apply_in_place(target) == ["w", "h"]
    assert all(same_bytes(target[k], new[k]) for k in new)
    assert {k: v.data_ptr() for k, v in target.items()} == pointers  # in place: same storage
    assert tensor_hashes(target) == tensor_hashes(new) == encoder.hashes()


def test_every_corrupted_byte_and_every_truncation_is_refused():
    encoder = DeltaEncoder()
    encoder.reset(_state(), 0)
    data = encoder.encode(_changed(_state()), 1).to_bytes()
    assert len(data) < 2000  # small enough to try every byte
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        with pytest.raises(CheckpointError, match="delta payload"):
            DeltaPayload.from_bytes(bytes(damaged))
    for n in range(len(data)):
        with pytest.raises(CheckpointError, match="delta payload: truncated"):
            DeltaPayload.from_bytes(data[:n])
    with pytest.raises(CheckpointError, match="bad magic"):
        DeltaPayload.from_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(CheckpointError, match="trailing bytes"):
        DeltaPayload.from_bytes(data + b"\x00")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        DeltaPayload.from_bytes(data[:-1] + bytes([data[-1] ^ 1]))


def test_a_payload_modified_in_memory_is_refused_with_the_target_unchanged():
    encoder = DeltaEncoder()
    encoder.reset(_state(), 0)
    payload = encoder.encode(_changed(_state()), 1)
    target = _state()
    blob = bytearray(payload.entries[0].blob)
    blob[0] ^= 1
    payload.entries[0].blob = bytes(blob)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        payload.apply_in_place(target)
    payload = encoder.encode(_changed(_changed(_state())), 2)  # a fresh, intact one ...
    payload.entries[0].changed += 1  # ... whose metadata is then altered
    with pytest.raises(CheckpointError, match="no longer match its header"):
        payload.apply_in_place(target)
    assert all(same_bytes(target[k], v) for k, v in _state().items())


def test_apply_to_returns_new_tensors_and_leaves_the_input():
    encoder = DeltaEncoder()
    encoder.reset(_state(), 0)
    payload = encoder.encode(_changed(_state()), 1)
    target = _state()
    produced = payload.apply_to(target)
    assert set(produced) == {"w", "h"}
    assert all(same_bytes(produced[k], _changed(_state())[k]) for k in produced)
    assert all(same_bytes(target[k], v) for k, v in _state().items())


def test_a_receiver_whose_bytes_diverged_refuses_before_writing():
    encoder = DeltaEncoder()
    encoder.reset(_state(), 0)
    payload = encoder.encode(_changed(_state()), 1)
    target = _state()
    as_ints(target["h"])[0] += 1  # the receiver no longer holds the base
    expected = {k: v.clone() for k, v in target.items()}
    with pytest.raises(CheckpointError, match="not this delta's base"):
        payload.apply_in_place(target)
    assert all(same_bytes(target[k], expected[k]) for k in target)
    with pytest.raises(CheckpointError, match="is bfloat16\\[300\\] in the payload, float32"):
        payload.apply_in_place({**_state(), "h": torch.zeros(300)})
    with pytest.raises(CheckpointError, match="not a tensor of the receiver"):
        payload.apply_in_place({"w": _state()["w"]})


def test_encoder_checks_its_inputs():
    encoder = DeltaEncoder()
    with pytest.raises(CheckpointError, match="no base yet"):
        encoder.encode(_state(), 1)
    encoder.reset(_state(), 3)
    with pytest.raises(CheckpointError, match="does not follow"):
        encoder.encode(_changed(_state()), 3)
    with pytest.raises(CheckpointError, match="missing \\['steps'\\]"):
        encoder.encode({k: v for k, v in _state().items() if k != "steps"}, 4)
    with pytest.raises(CheckpointError, match="the held one float32"):
        encoder.encode({**_state(), "w": _state()["w"].double()}, 4)
    assert encoder.version == 3  # nothing was committed
    with pytest.raises(ValueError, match="choose from"):
        DeltaEncoder(encodings=("xor",))
    empty = encoder.encode(_state(), 4)  # nothing changed: an empty payload still moves the version
    assert empty.entries == [] and DeltaPayload.from_bytes(empty.to_bytes()).version == 4


# ---------------------------------------------------------------- the engine
def _trainer_and_engines(**overrides):
    torch.manual_seed(0)
    trainer = GLMForCausalLM(small_config("moe", **overrides))
    fp32 = GLMForCausalLM(trainer.config)
    fp32.load_state_dict(trainer.state_dict())
    bf16 = GLMForCausalLM(trainer.config)
    bf16.load_state_dict(trainer.state_dict())
    bf16.to(torch.bfloat16)
    return trainer, InProcessEngine(fp32.eval()), InProcessEngine(bf16.eval())


def _bf16(state):
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def test_fifty_training_updates_keep_the_engines_byte_identical():
    """25 Muon steps then 25 AdamW steps on an fp32 trainer; after each, a delta goes through bytes to an
    fp32 engine and to a bf16 engine (the trainer's weights cast), which then hold exactly its bytes."""
    trainer, engine32, engine16 = _trainer_and_engines()
    enc32, enc16 = DeltaEncoder(), DeltaEncoder()
    enc32.reset(trainer.state_dict(), 0)
    enc16.reset(_bf16(trainer.state_dict()), 0)
    schedule = ScheduleConfig(peak_lr=2e-3, floor_lr=2e-3, warmup_tokens=0, total_tokens=10**9)
    muon = build_for_model(trainer, OptimConfig(), schedule)
    adamw = torch.optim.AdamW(trainer.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(5)
    used, wire, full = {}, {"fp32": 0, "bf16": 0}, {"fp32": 0, "bf16": 0}
    for step in range(1, 51):
        tokens = torch.randint(0, trainer.config.vocab_size, (2, 16), generator=g)
        trainer.zero_grad()
        trainer(tokens, labels=tokens).loss.backward()
        if step <= 25:
            muon.set_tokens(step * tokens.numel())
            muon.step()
        else:
            adamw.step()
        for kind, encoder, engine, state in (("fp32", enc32, engine32, trainer.state_dict()),
                                             ("bf16", enc16, engine16, _bf16(trainer.state_dict()))):
            payload = DeltaPayload.from_bytes(encoder.encode(state, step).to_bytes())
            assert payload.base_version == step - 1 and engine.weight_version == step - 1
            assert engine.update_weights(payload) == step == engine.weight_version
            assert_holds(engine.model, state)
            for e in payload.entries:
                numel = state[e.name].numel()
                assert len(e.blob) <= numel * state[e.name].element_size()  # never more than the full bytes
                used[e.encoding] = used.get(e.encoding, 0) + 1
            wire[kind] += payload.nbytes
            full[kind] += sum(v.numel() * v.element_size() for v in state.values())
    # Dense fp32 changes go through zstd; bf16 rounding leaves some tensors sparsely changed.
    assert used.get("zstd_diff", 0) > 0 and used.get("zstd_gaps", 0) > 0, used
    assert wire["fp32"] < 0.75 * full["fp32"] and wire["bf16"] < 0.5 * full["bf16"], (wire, full)


def test_engine_refuses_a_wrong_base_and_a_corrupted_payload_with_weights_unchanged():
    trainer, engine, _ = _trainer_and_engines()
    encoder = DeltaEncoder()
    encoder.reset(trainer.state_dict(), 0)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(1.01)
    first = encoder.encode(trainer.state_dict(), 1)
    assert engine.update_weights(first) == 1
    held = snapshot(engine.model)
    with pytest.raises(CheckpointError, match="from weight version 0, the engine holds 1"):
        engine.update_weights(first)  # applying it twice would be a wrong base
    with torch.no_grad():
        trainer.model.embed_tokens.weight.add_(0.5)
    second = encoder.encode(trainer.state_dict(), 2)
    data = bytearray(second.to_bytes())
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        engine.update_weights(DeltaPayload.from_bytes(bytes(data)))
    damaged = DeltaPayload.from_bytes(second.to_bytes())
    damaged.entries[0].blob = bytes(len(damaged.entries[0].blob))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        engine.update_weights(damaged)
    with pytest.raises(ValueError, match="version 7 given for a delta to version 2"):
        engine.update_weights(second, version=7)
    assert engine.weight_version == 1
    assert_holds(engine.model, held)
    assert engine.update_weights(second) == 2
    assert_holds(engine.model, snapshot(trainer))


def test_tied_weights_are_sent_once():
    trainer, engine, _ = _trainer_and_engines(tie_word_embeddings=True)
    for model in (trainer, engine.model):
        assert model.lm_head.weight is model.model.embed_tokens.weight
    encoder = DeltaEncoder()
    encoder.reset(trainer.state_dict(), 0)
    with torch.no_grad():
        trainer.lm_head.weight.add_(0.125)
    payload = encoder.encode(trainer.state_dict(), 1)
    assert payload.names == ["model.embed_tokens.weight"]
    engine.update_weights(payload)
    assert_holds(engine.model, snapshot(trainer))


def test_a_version_in_row_pieces_from_two_senders():
    """Where trainer ranks hold row shards, each encodes its own rows ("NAME[a:b]") and the version comes as
    two payloads: after the first (not final) the engine still reports the base version, after the second
    it holds the trainer's bytes at the new one. A piece outside the tensor's rows is refused."""
    from orthon.pretrain.hf_io import row_piece_name

    trainer, engine, _ = _trainer_and_engines()

    def pieces(half):
        out = []
        for name, t in trainer.state_dict().items():
            if t.dim() == 0 or t.shape[0] < 2:
                if half == 0:
                    out.append((name, t))
                continue
            cut = t.shape[0] // 2
            first, last = (0, cut) if half == 0 else (cut, t.shape[0])
            out.append((row_piece_name(name, first, last), t[first:last]))
        return out

    encoders = [DeltaEncoder(), DeltaEncoder()]
    for half, encoder in enumerate(encoders):
        encoder.reset(pieces(half), 0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    first = encoders[0].encode(pieces(0), 1, final=False)
    second = DeltaPayload.from_bytes(encoders[1].encode(pieces(1), 1).to_bytes())
    assert not DeltaPayload.from_bytes(first.to_bytes()).final and second.final
    assert any(n.endswith("]") for n in first.names) and any(n.endswith("]") for n in second.names)
    assert engine.update_weights(DeltaPayload.from_bytes(first.to_bytes())) == 0
    assert engine.update_weights(second) == 1
    assert_holds(engine.model, snapshot(trainer))
    name = "model.norm.weight"
    rows = trainer.state_dict()[name].shape[0]
    stray = DeltaEncoder()
    stray.reset([(row_piece_name(name, rows, rows + 2), torch.zeros(2))], 1)
    with pytest.raises(CheckpointError, match=r"rows outside the receiver's"):
        engine.update_weights(stray.encode([(row_piece_name(name, rows, rows + 2), torch.ones(2))], 2))
