"""Reports drawn from run and evaluation directories (training curves, evaluation tables)."""
