"""The names a run manifest and the command line choose among, without the code behind them.

``p2pdiloco.aggregate``, ``p2pdiloco.compress`` and ``p2pdiloco.train.attacks`` import torch;
``--help`` and the checks of a user's flags need only these names, so they live here
(``tests/test_cli_startup.py`` checks each registry lists exactly these), with the one check of
which choices go together that a run's creator gets before anything heavy is imported.
"""

from __future__ import annotations

from p2pdiloco.errors import ConfigError

# Merge rules (p2pdiloco.aggregate), in the order `--help` lists them.
RULES: tuple[str, ...] = (
    "mean",
    "sender_mean",
    "median",
    "trimmed_mean",
    "krum",
    "multi_krum",
    "centered_clip",
    "geometric_median",
)
# Delta codecs (p2pdiloco.compress).
CODECS: tuple[str, ...] = ("none", "fp16", "int8", "int4", "topk2")
# Codecs of a certified update of the merged gradient (SyncRules.update_codec, ADR 0029): dense
# ones only. A sparse g would need error feedback that followers cannot recompute.
UPDATE_CODECS: tuple[str, ...] = ("none", "fp16", "int8", "int4")
# Codecs of an update that is the parameters' change (SyncRules.update_form "params", ADR 0064):
# every one, sparse included: the committee keeps what it did not send as error feedback.
PARAMS_UPDATE_CODECS: tuple[str, ...] = CODECS
# Attacks a test or demo node can play (p2pdiloco.train.attacks).
ATTACKS: tuple[str, ...] = (
    "sign-flip",
    "scale",
    "noise",
    "alie",
    "ipm",
    "replay",
    "inflate",
    "mimic",
    "collude",
)

# Codecs that send a small share of the entries, and the rules that merge each coordinate on
# its own: on such deltas (1/64 of the entries kept) most coordinates are zero in most deltas,
# and the loss measured was 1.9x (trimmed mean) and 3.3x (median) of the mean's, while Krum
# stayed at 1.0x (bench/sparse_rules.py, docs/adr/0018-sparse-codec.md).
SPARSE_CODECS = ("topk2",)
COORDINATE_RULES = ("median", "trimmed_mean")


def check_sparse_rule(compression: str, aggregation: str) -> None:
    """ConfigError (one line) for a run that would merge sparse deltas coordinate by coordinate.
    A creator's check (``run create``, ``demo``), not a join check: a signed run stays
    followable."""
    if compression in SPARSE_CODECS and aggregation in COORDINATE_RULES:
        raise ConfigError(
            f"compression {compression} with aggregation {aggregation}: sparse deltas are "
            "mostly zeros, so a coordinate-wise rule shrinks the update to almost nothing "
            "(docs/adr/0018-sparse-codec.md); use multi_krum, krum, centered_clip, "
            "geometric_median or mean"
        )
