// Command run_controller runs a Python controller on an l4m cluster and streams its output, like
// `l4m run`: messages to stdout, log lines to stderr, and the instance's exit status as its own.
//
//	export L4M_API_KEY=$(cat /tmp/l4m-$USER/admin.key)   # the key `l4m up` wrote
//	run_controller -spawner 127.0.0.1:7410 examples/controllers/text_completion.py -- --max-tokens 8 "What is 2+2?"
package main

import (
	"context"
	"flag"
	"fmt"
	"os"

	"l4m"
	l4mv1 "l4m/v1"
)

func main() {
	spawner := flag.String("spawner", "127.0.0.1:7410", "spawner address (host:port)")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: %s [-spawner HOST:PORT] PROGRAM.py [-- ARGS...]\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() < 1 {
		flag.Usage()
		os.Exit(2)
	}
	client, err := l4m.Dial(*spawner)
	if err != nil {
		fail(err)
	}
	defer client.Close()
	exit, err := client.Run(context.Background(), flag.Arg(0), flag.Args()[1:], printEvent)
	if err != nil {
		fail(err)
	}
	os.Exit(l4m.ExitStatus(exit))
}

func printEvent(event *l4mv1.AttachResponse) {
	switch e := event.Event.(type) {
	case *l4mv1.AttachResponse_Message:
		fmt.Println(e.Message.Text)
	case *l4mv1.AttachResponse_Log:
		fmt.Fprintln(os.Stderr, e.Log.Line)
	case *l4mv1.AttachResponse_Exit:
		if e.Exit.Reason != l4mv1.ExitReason_EXIT_REASON_EXITED {
			fmt.Fprintf(os.Stderr, "l4m: the controller ended: %s: %s\n", e.Exit.Reason, e.Exit.Message)
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "l4m:", err)
	os.Exit(1)
}
