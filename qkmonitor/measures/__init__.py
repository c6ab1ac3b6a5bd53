"""The math: the metrics' definitions in float math (:mod:`.spectra`, :mod:`.ranks`,
:mod:`.entropies`, :mod:`.probabilities`), the spectra of a layer's heads (:mod:`.gram_spectra`;
over a model's layers, :mod:`.layer_spectra`), the aggregators that accumulate a probe's statistics
and reduce them across ranks (:mod:`.metrics`), the catalogue of every logged metric
(:mod:`.catalogue`), and values read to the host in one transfer a device (:mod:`.transfer`).
"""
