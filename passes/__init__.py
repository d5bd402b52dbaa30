"""Compiler passes, one per file.

| file          | pass      | kind     | does                                                        |
|---------------|-----------|----------|-------------------------------------------------------------|
| capture.py    | capture   | graph    | model + sample batch -> fx.GraphModule, nodes tagged with layer and region |
| annotate.py   | annotate  | graph    | FLOPs, saved bytes, parameter and boundary bytes per node and layer; the LayerGraph |

The pass list is built and run by :mod:`vlmcompile.compiler`.
"""
