"""Reference tasks and DataModules: demo models (timm image classifier, HF GPT-2 and BERT) and data sets (CIFAR-10,
text files, SST-2, the Python stdlib corpus) with their tokenizers and caches. They are demos of the contract in
``docs/architecture.md``, not part of it: every technique works on your own LightningModule and DataModule."""
