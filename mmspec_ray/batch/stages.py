"""The CPU stages around the decoder actors: drop rows already done, decode media ahead of the actors.

Both are plain functions on pyarrow tables, run by Ray Data as stateless tasks.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from mmspec_ray.batch.rows import ERROR_COL, ERROR_KIND_COL, REQUEST_COL, RowError, prepare_row, readable_block
from mmspec_ray.batch.storage import escape_invalid_utf8
from mmspec_ray.batch.jobspec import DecodeConfig


def keep_ids(batch: pa.Table, ids: pa.Array) -> pa.Table:
    """Rows whose `id` is in `ids` (the rows this run still has to do; a non-UTF-8 id compared as written)."""
    return batch.filter(pc.is_in(escape_invalid_utf8(batch.column("id"))[0], value_set=ids))


def prepare_block(batch: pa.Table, cfg: DecodeConfig, tracker: Any = None, max_row_crashes: int | None = None,
                  row_fn: Callable[..., Any] = prepare_row) -> pa.Table:
    """Decode each row's media into a pickled `Request` (or record the row's error) so that decoder actors spend
    their time on the model, not on fetching and decoding media. With `tracker`, a row whose media killed this task's
    process `max_row_crashes` times (Ray retries the task) is filed as error kind `crash` instead. Text that is not
    valid UTF-8 is that row's `invalid` error (`readable_block`), and the block goes on in its readable form."""
    blobs: list[bytes | None] = []
    errors: list[str | None] = []
    kinds: list[str | None] = []
    batch, unreadable = readable_block(batch)  # a value that is not UTF-8 fails its row, not the block
    for row, bad in zip(batch.to_pylist(), unreadable):
        if bad is not None:
            blobs.append(None)
            errors.append(str(bad))
            kinds.append(bad.kind)
            continue
        key = f"media:{row.get('id')}"
        died = ray.get(tracker.start_row.remote(key)) if tracker is not None and max_row_crashes else 0
        if died and died >= max_row_crashes:
            blobs.append(None)
            errors.append(f"media: the media decoding process died {died} times on this row (out of memory or a "
                          "crash in an image / video decoder); filed as an error. Retry with --retry-errors crash")
            kinds.append("crash")
            continue
        try:
            request = row_fn(row, cfg)
        except RowError as e:
            blobs.append(None)
            errors.append(str(e))
            kinds.append(e.kind)
            continue
        except Exception as e:  # unexpected decoder failure on odd input: still that row's error only
            blobs.append(None)
            errors.append(f"media: {type(e).__name__}: {e}")
            kinds.append("internal")
            continue
        finally:
            if tracker is not None and max_row_crashes:
                tracker.finish_row.remote(key)
        blobs.append(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        errors.append(None)
        kinds.append(None)
    return (batch.append_column(REQUEST_COL, pa.array(blobs, type=pa.large_binary()))
            .append_column(ERROR_COL, pa.array(errors, type=pa.string()))
            .append_column(ERROR_KIND_COL, pa.array(kinds, type=pa.string())))
