"""Predictors of upcoming experts, one interface and one registry (see ``base``)."""

from expertcache.predict.base import PredictContext, Predictor, PredictorError, rank_union
from expertcache.predict.registry import PREDICTORS, make_predictor, predictor_class

__all__ = [
    "PREDICTORS",
    "PredictContext",
    "Predictor",
    "PredictorError",
    "make_predictor",
    "predictor_class",
    "rank_union",
]
