"""Safe loading of fairseq checkpoints on torch >= 2.6.

torch.load defaults to weights_only=True there, and fairseq's checkpoints hold
a few non-tensor types (argparse.Namespace, omegaconf containers, fairseq's
logging meters, numpy scalars) that it refuses, so resume, fairseq-generate and
fairseq-validate fail. This module allowlists exactly those types with
``torch.serialization.add_safe_globals``; weights_only stays on, and a
checkpoint that pickles any other type is still refused with torch's message
naming that type.
"""
import argparse
import collections
import typing

import numpy as np
import torch


def fairseq_checkpoint_types():
    """The classes and functions that fairseq checkpoints pickle besides tensors."""
    from fairseq.logging import meters
    from omegaconf import DictConfig, ListConfig, base, nodes

    types = [
        argparse.Namespace,
        collections.defaultdict,
        collections.OrderedDict,
        typing.Any,
        DictConfig,
        ListConfig,
        base.ContainerMetadata,
        base.Metadata,
        nodes.AnyNode,
        nodes.StringNode,
        nodes.IntegerNode,
        nodes.FloatNode,
        nodes.BooleanNode,
        nodes.EnumNode,
        meters.AverageMeter,
        meters.SumMeter,
        meters.TimeMeter,
        meters.StopwatchMeter,
        meters.MetersDict,
        np.dtype,
        np.core.multiarray.scalar if hasattr(np, "core") else np._core.multiarray.scalar,
    ]
    types += [type(np.dtype(t)) for t in (np.float64, np.float32, np.int64, np.int32, np.bool_)]
    return types


def allow_fairseq_checkpoint_types():
    torch.serialization.add_safe_globals(fairseq_checkpoint_types())
