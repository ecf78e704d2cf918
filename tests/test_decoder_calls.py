"""The Decoder is transactional and single-threaded: a call that fails part-way leaves it refusing every call but
``reset`` (saying why) instead of continuing from caches that no longer match ``lengths``; a call while another
thread's call runs is refused; a refusal before any work changes nothing; every integer id dtype is accepted."""

from __future__ import annotations

import threading

import pytest
import torch

import kimik3


def _decoder(batch: int = 2) -> kimik3.Decoder:
    return kimik3.Decoder(kimik3.from_preset("micro", seed=0), stage="naive", batch_size=batch, max_seq_len=32)


def _prompt(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, 5), generator=torch.Generator().manual_seed(1))


def test_a_step_that_raises_part_way_leaves_the_decoder_refusing_until_reset() -> None:
    dec, ref = _decoder(), _decoder()
    ids = _prompt()
    dec.prefill(ids)
    ref.prefill(ids)
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    hook = dec.model.lm_head.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        dec.step(torch.tensor([3, 4]))  # every layer's cache advanced, lengths did not
    hook.remove()
    for call in (lambda: dec.step(torch.tensor([3, 4])), lambda: dec.prefill(ids), lambda: dec.generate(ids, 2)):
        with pytest.raises(ValueError, match=r"unusable: step\(\) failed part-way \(KeyboardInterrupt.*reset\(\)"):
            call()
    dec.reset()
    torch.testing.assert_close(dec.prefill(ids), ref.prefill(ids), rtol=0, atol=0)
    torch.testing.assert_close(dec.step(torch.tensor([3, 4])), ref.step(torch.tensor([3, 4])), rtol=0, atol=0)


def test_a_refused_call_changes_nothing() -> None:
    dec, ref = _decoder(), _decoder()
    ids = _prompt()
    dec.prefill(ids)
    ref.prefill(ids)
    for bad in (torch.tensor([3]), torch.tensor([3.0, 4.0]), torch.tensor([3, 10**6]), [[1, 2]]):
        with pytest.raises(ValueError):
            dec.step(bad)
    torch.testing.assert_close(dec.step(torch.tensor([3, 4])), ref.step(torch.tensor([3, 4])), rtol=0, atol=0)


def test_a_call_from_a_second_thread_is_refused() -> None:
    dec = _decoder()
    ids = _prompt()
    dec.prefill(ids)
    inside, release = threading.Event(), threading.Event()

    def block(*_: object) -> None:
        inside.set()
        release.wait(30)

    hook = dec.model.lm_head.register_forward_hook(block)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _capture(errors, dec.step, torch.tensor([3, 4])))
    t.start()
    assert inside.wait(30)
    try:
        for call in (lambda: dec.step(torch.tensor([5, 6])), dec.reset, lambda: dec.prefill(ids)):
            with pytest.raises(ValueError, match="another call on this Decoder is running"):
                call()
    finally:
        release.set()
        t.join(30)
        hook.remove()
    assert errors == [] and not t.is_alive()
    assert int(dec.lengths.max()) == 6  # the first thread's step completed, the refused ones did nothing


def _capture(errors: list[BaseException], fn, *args) -> None:  # noqa: ANN001
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                                   torch.int64, torch.uint64])
def test_every_integer_dtype_is_a_token_id(dtype: torch.dtype) -> None:
    dec, ref = _decoder(), _decoder()
    ids = _prompt()
    torch.testing.assert_close(dec.prefill(ids.to(dtype)), ref.prefill(ids), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [torch.tensor([[True, False]] * 2), torch.zeros(2, 3, dtype=torch.complex64),
                                 "12", object()])
def test_non_integer_ids_are_refused_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match="input_ids must be"):
        _decoder().prefill(bad)
