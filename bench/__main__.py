import sys

if sys.argv[1:2] == ["scaleout"]:  # 1 versus 2 llm workers (bench/scaleout.py)
    from bench.scaleout import main as scaleout_main

    sys.exit(scaleout_main(sys.argv[2:]))

from bench.run import main

sys.exit(main())
