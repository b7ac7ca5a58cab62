"""orthon.core: the bottom layer every other package builds on: typed configs, plug-ins, atomic files,
errors, metrics, distributed helpers. It imports nothing of orthon."""
