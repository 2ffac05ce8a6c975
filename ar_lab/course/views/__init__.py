"""Views and widgets: the explorers' pure functions (``sampler_view``, ``speculative_view``,
``gpu_view``) and the ipywidgets shells over them (``widgets``, ``gpu_explorer``, ``kv_calculator``,
``quant_view``), the self-check quizzes (``quiz``, ``quiz_bank``) and the one plot style
(``plots``)."""
