from dflashctl.entry import main

main()
