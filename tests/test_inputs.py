"""The one input model: every operand random from the seed or an .npy file, checked once."""

from __future__ import annotations

import pickle
from typing import Literal

import numpy as np
import pytest
from pydantic import Field, ValidationError

from mgpu import inputs
from mgpu.inputs import InputParams, Operand
from mgpu.worker import sources
from mgpu.worker.sources import NpySource, RandomSource


class ChainParams(InputParams):
    """Three operands sharing axes: p (r, s), q (s, t), v (t,)."""

    input_operands = (Operand("p", ("r", "s")), Operand("q", ("s", "t")), Operand("v", ("t",)))

    r: int | None = Field(None, gt=0)
    s: int | None = Field(None, gt=0)
    t: int | None = Field(None, gt=0)
    dtype: Literal["float32", "float64"] | None = None


def _files(tmp_path, **arrays):
    for name, arr in arrays.items():
        np.save(tmp_path / f"{name}.npy", arr)
    return {name: str(tmp_path / f"{name}.npy") for name in arrays}


def test_random_inputs_need_every_size_and_take_the_default_dtype():
    p = ChainParams(r=2, s=3, t=4, seed=7)
    assert p.dtype == "float32"
    assert p.sources() == (
        RandomSource(7, 0, (2, 3), "float32"),
        RandomSource(7, 1, (3, 4), "float32"),
        RandomSource(7, 2, (4,), "float32"),
    )
    with pytest.raises(ValidationError, match="t: required when input is random"):
        ChainParams(r=2, s=3)


def test_files_give_the_sizes_and_dtype_read_once(tmp_path, monkeypatch):
    files = _files(tmp_path, p=np.ones((2, 3), np.float64), q=np.ones((3, 5), np.float64), v=np.ones(5, np.float64))
    p = ChainParams(input=files)
    assert (p.r, p.s, p.t, p.dtype) == (2, 3, 5, "float64")
    # The workers never read a header again: the sources come from what validation read,
    # also in a copy of the params sent through pickle as a task's argument.
    monkeypatch.setattr(sources, "inspect_npy", lambda *a, **k: pytest.fail("header read again"))
    monkeypatch.setattr(inputs, "inspect_npy", lambda *a, **k: pytest.fail("header read again"))
    for params in (p, pickle.loads(pickle.dumps(p))):
        got = params.sources()
        assert all(isinstance(s, NpySource) for s in got)
        assert [s.shape for s in got] == [(2, 3), (3, 5), (5,)]


@pytest.mark.parametrize(
    "arrays,given,message",
    [
        (
            dict(p=(2, 3), q=(4, 5), v=(5,)),
            {},
            "input: p is (2, 3) and q is (4, 5); p's axis 1 and q's axis 0 are both s",
        ),
        (dict(p=(2, 3), q=(3, 5), v=(6,)), {}, "input: q is (3, 5) and v is (6,)"),
        (dict(p=(2, 3), q=(3, 5), v=(5, 1)), {}, "input.v: expected a 1-D array"),
        (dict(p=(2, 3), q=(3, 5), v=(5,)), {"r": 9}, "r: 9 disagrees with the input files (2)"),
        (dict(p=(2, 3), q=(3, 5), v=(5,)), {"dtype": "float32"}, "dtype: float32 disagrees"),
    ],
)
def test_files_that_disagree_are_refused_naming_the_key(tmp_path, arrays, given, message):
    files = _files(tmp_path, **{k: np.ones(shape) for k, shape in arrays.items()})
    with pytest.raises(ValidationError) as e:
        ChainParams(input=files, **given)
    assert message in str(e.value)


def test_file_dtypes_must_match(tmp_path):
    files = _files(tmp_path, p=np.ones((2, 3), np.float32), q=np.ones((3, 5)), v=np.ones(5))
    with pytest.raises(ValidationError, match="input: p holds float32 and q holds float64; they must match"):
        ChainParams(input=files)


@pytest.mark.parametrize(
    "value,message",
    [
        ("zeros", "expected 'random' or the files {p: p.npy, q: q.npy, v: v.npy}"),
        ({"p": "p.npy", "q": "q.npy"}, "missing 'v'"),
        ({"p": "p.npy", "q": "q.npy", "v": "v.npy", "w": "w.npy"}, "unknown key 'w'; allowed: p, q, v"),
        ({"p": "p.npy", "q": "q.npy", "v": 3}, "expected a path for each of p, q, v"),
    ],
)
def test_the_input_key_lists_the_operands(value, message):
    with pytest.raises(ValidationError, match=message.replace("{", r"\{").replace("}", r"\}")):
        ChainParams(input=value)
