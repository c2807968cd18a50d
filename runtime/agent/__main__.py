from monarch.runtime.agent.main import main

main()
