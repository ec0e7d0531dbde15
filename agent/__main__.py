from clusterpulse.agent.cli import main

raise SystemExit(main())
