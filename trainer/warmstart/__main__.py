"""`python -m clusterpulse.trainer.warmstart`: torchrun with warm ranks (see the package).

Why a package's `__main__` and not a module run with -m: multiprocessing starts each
rank by running its parent's main module again, by name, in the child (as
`__mp_main__`), except a package's `__main__`. Here the parent is this launcher and
the child a fork of the server, which has already imported the warmstart module (the
reference trainer and the server's session module import it): runpy then warned
"'clusterpulse.trainer.warmstart' found in sys.modules ... prior to execution" once
per rank on every start, and each rank re-executed the launcher's imports for
nothing. A package's `__main__` is skipped, so the ranks run nothing of it.
"""

from clusterpulse.trainer.warmstart import main

main()
