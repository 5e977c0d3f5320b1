"""The undo stack that every multi-step operation uses: undos run last first, only for steps that succeeded."""

from __future__ import annotations

import pytest
from hbmd.proto.undo import Undo

pytestmark = pytest.mark.unit


def test_a_failing_step_undoes_the_steps_before_it_in_reverse() -> None:
    done: list[str] = []
    with pytest.raises(ValueError, match="step 3"):
        with Undo() as undo:
            for step in (1, 2, 3):
                if step == 3:
                    raise ValueError("step 3")
                done.append(f"do {step}")
                undo.push(done.append, f"undo {step}")
    assert done == ["do 1", "do 2", "undo 2", "undo 1"]


def test_a_block_that_ends_normally_keeps_every_step() -> None:
    done: list[str] = []
    with Undo() as undo:
        undo.push(done.append, "undo")
    assert done == []


def test_a_failing_undo_does_not_stop_the_others_nor_hide_the_first_error() -> None:
    done: list[str] = []

    def broken() -> None:
        raise OSError("undo failed")

    with pytest.raises(KeyError):
        with Undo() as undo:
            undo.push(done.append, "first")
            undo.push(broken)
            raise KeyError("the step")
    assert done == ["first"]


def test_commit_forgets_the_undos_and_rollback_runs_them_once() -> None:
    done: list[int] = []
    undo = Undo()
    undo.push(done.append, 1)
    undo.commit()
    undo.rollback()
    undo.push(done.append, 2)
    undo.rollback()
    undo.rollback()
    assert done == [2]
