"""The tuner's mind, standard library only: window stats, records, the performance model, history and the policy."""
