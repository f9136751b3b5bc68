"""Analyze a DataModule's training set for curriculum learning (DataAnalyzer, conf/analyze.yaml). From the repo root:

python experiments/analyze.py data=shakespeare_mlm analyzer.metrics='{seqlen: {}}' analyzer.num_threads=2
python experiments/analyze.py stage=map analyzer.num_workers=2 analyzer.worker_id=1   # one machine's share
"""

import hydra
from omegaconf import DictConfig

from lightning_effi.curriculum.analysis.__main__ import analyze


@hydra.main(version_base="1.3", config_path="../conf", config_name="analyze")
def main(cfg: DictConfig) -> None:
    analyze(cfg)


if __name__ == "__main__":
    main()
