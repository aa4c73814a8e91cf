"""Scheduled retraining with a quality gate and the MLflow registry (`dominospec retrain`, docs/operations.md).

  lock.py      one retrain at a time (flock + holder pid; a dead holder's lock is taken over)
  gate.py      candidate vs champion on the gate suite -> promote or not, and why (pure)
  registry.py  the registered model: versions, gate tags, the `champion` alias, the champion's draft
  job.py       the retrain itself: commands -> eval.json -> register -> gate -> alias, + retrain.json
"""
