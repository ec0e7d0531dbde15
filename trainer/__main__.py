from clusterpulse.trainer.main import main

raise SystemExit(main())
