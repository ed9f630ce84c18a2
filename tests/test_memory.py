"""mgpu.memory: the allocator choices are one enum that the job file, the flags and
``mgpu info`` all take theirs from, and each choice becomes the RMM setup it names."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import yaml
from conftest import invoke

from mgpu.cli import cli
from mgpu.memory import AllocatorChoice, rmm_options
from mgpu.spec import validate_job

ROOT = Path(__file__).resolve().parents[1]


def test_the_choices_are_written_once():
    # Any two of the names side by side, quoted, outside the enum: a second copy of the list.
    names = "|".join(AllocatorChoice.names())
    pair = re.compile(rf"[\"']({names})[\"'],\s*[\"']({names})[\"']")
    copies = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "mgpu").rglob("*.py")
        if p.name != "allocator.py" and pair.search(p.read_text())
    ]
    assert copies == []


@pytest.mark.parametrize("command", ["submit", "scale"])
def test_the_allocator_flag_offers_the_choices(command):
    option = next(p for p in cli.commands[command].params if p.name == "allocator")
    assert isinstance(option.type, click.Choice)
    assert list(option.type.choices) == AllocatorChoice.names()


def test_a_job_file_takes_every_choice_and_keeps_it_as_written():
    for name in AllocatorChoice.names():
        job = validate_job({"workload": "dot", "params": {"n": 10}, "cluster": {"allocator": name}})
        assert job.cluster.allocator == name
        # The job as run is plain data: it goes to JSON and back into a job file.
        assert yaml.safe_load(yaml.safe_dump(job.as_dict()))["cluster"]["allocator"] == name


def test_a_bad_allocator_lists_the_choices(tmp_path):
    res = invoke("submit", tmp_path / "job.yaml", "--allocator", "slab")
    assert res.code == 2
    assert all(name in res.stderr for name in AllocatorChoice.names())


def test_info_lists_the_choices_with_rmm(monkeypatch):
    import importlib.util

    from mgpu import info

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "rmm" else real(name, *a))
    assert info.machine_info()["allocators"] == AllocatorChoice.names()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rmm" else real(name, *a))
    assert info.machine_info()["allocators"] == ["default"]


# -- the RMM setup of each choice ----------------------------------------------------------------


def test_pool_takes_the_budget_up_front_and_spill_caps_it():
    opts = rmm_options("pool", 0.8, "none")
    assert opts["rmm_pool_size"] == 0.8 and "rmm_maximum_pool_size" not in opts
    capped = rmm_options("pool", "40GB", "managed")
    assert capped["rmm_pool_size"] == capped["rmm_maximum_pool_size"] == "40GB"
    assert capped["rmm_allocator_external_lib_list"] == ["cupy"]  # CuPy allocates through RMM


def test_async_is_capped_only_when_it_spills():
    assert rmm_options("async", 0.5, "none")["rmm_async"] is True
    assert "rmm_maximum_pool_size" not in rmm_options("async", 0.5, "none")
    assert rmm_options("async", 0.5, "managed")["rmm_maximum_pool_size"] == 0.5
    assert "rmm_pool_size" not in rmm_options("async", 0.5, "managed")


def test_managed_and_default_take_no_pool():
    managed = rmm_options("managed", 0.8, "managed")  # nothing for spill to wrap: never capped
    assert managed["rmm_managed_memory"] is True
    assert not {"rmm_pool_size", "rmm_maximum_pool_size", "rmm_async"} & set(managed)
    assert rmm_options("default", 0.8, "managed") == {}  # CuPy's own pool, no RMM hook


def test_only_pool_and_async_can_spill():
    assert {c.value for c in AllocatorChoice if c.can_spill} == {"pool", "async"}
    with pytest.raises(ValueError):
        rmm_options("slab", 0.8, "none")
