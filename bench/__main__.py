import sys

if sys.argv[1:2] == ["scaleout"]:  # 1 versus 2 llm workers (bench/scaleout.py)
    from bench.scaleout import main as scaleout_main

    sys.exit(scaleout_main(sys.argv[2:]))

if sys.argv[1:2] == ["sweep"]:  # what the blob sweep costs (bench/sweep.py)
    from bench.sweep import main as sweep_main

    sys.exit(sweep_main(sys.argv[2:]))

from bench.run import main

sys.exit(main())
