"""Train a model as configured in conf/ (Hydra). Run from the repository root.

python experiments/train.py                                  # one run: GPT-2, stdlib corpus (main job: compare.py)
python experiments/train.py experiment=cifar10_cnn           # another experiment (conf/experiment/)
python experiments/train.py -m seed=0,1 trainer.max_epochs=1 # multirun sweep
python experiments/train.py ckpt_path=logs/.../checkpoints/last.ckpt   # resume
"""

import hydra
from omegaconf import DictConfig

from lightning_effi.train import main as run_main


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    return run_main(cfg)


if __name__ == "__main__":
    main()
