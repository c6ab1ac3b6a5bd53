"""What the monitors write and how it is read back: the tag grammar (:mod:`.tags`), the sinks
(:mod:`.sinks`) and their fault guard (:mod:`.guard`), the background thread that draws the
visuals (:mod:`.publisher`), the TensorBoard layout and images (:mod:`.dashboards`), and the
report that reads a run's events (:mod:`.report`).
"""
