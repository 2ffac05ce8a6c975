"""The course layer: checkers and named mistakes, claims, quizzes, exercises, widgets and the
explorers' views, plots. It calls every layer below it; nothing below imports it."""
