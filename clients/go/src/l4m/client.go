// Package l4m is a thin client of l4m's SpawnerService: upload a controller program, launch instances
// of it, attach to their output, send them messages and terminate them. The generated stubs it wraps
// live in l4m/v1 (package l4mv1); use them directly for anything this package leaves out.
//
// Every call carries the user's API key as `authorization: Bearer <key>` metadata (Dial takes it from
// $L4M_API_KEY; DialWithAPIKey from its argument): a spawner without --insecure-local refuses a call
// without one (UNAUTHENTICATED).
package l4m

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	l4mv1 "l4m/v1"

	"google.golang.org/grpc"
)

// ChunkBytes is the largest upload chunk the spawner accepts.
const ChunkBytes = 1 << 20

// Client talks to one spawner. Every unary call gets Timeout as its deadline.
type Client struct {
	Address string
	Timeout time.Duration
	conn    *grpc.ClientConn
	stub    l4mv1.SpawnerServiceClient
}

// Dial connects to a spawner at "host:port" (plaintext, as `l4m up` serves it), with the API key in
// $L4M_API_KEY.
func Dial(address string) (*Client, error) {
	return DialWithAPIKey(address, os.Getenv("L4M_API_KEY"))
}

// DialWithAPIKey connects to a spawner at "host:port" (plaintext) and presents apiKey on every call
// (none when empty).
func DialWithAPIKey(address, apiKey string) (*Client, error) {
	// WithInsecure, not credentials/insecure: Debian bookworm ships grpc-go 1.33, which predates it.
	options := []grpc.DialOption{grpc.WithInsecure()}
	if apiKey != "" {
		options = append(options, grpc.WithPerRPCCredentials(bearer(apiKey)))
	}
	conn, err := grpc.Dial(address, options...)
	if err != nil {
		return nil, fmt.Errorf("dial spawner %s: %w", address, err)
	}
	return &Client{Address: address, Timeout: 30 * time.Second, conn: conn, stub: l4mv1.NewSpawnerServiceClient(conn)}, nil
}

// bearer is an API key as per-call credentials.
type bearer string

func (key bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(key)}, nil
}

// RequireTransportSecurity is false: `l4m up` serves plaintext on loopback. Keys are bearer secrets:
// beyond loopback, use TLS.
func (bearer) RequireTransportSecurity() bool { return false }

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

// uploadStatus turns the io.EOF of a Send on a stream the server ended (a refused API key, a program
// too large) into the server's status, which only the stream's receive side carries.
func uploadStatus(stream l4mv1.SpawnerService_UploadProgramClient, err error) error {
	if err != io.EOF {
		return err
	}
	if _, recvErr := stream.CloseAndRecv(); recvErr != nil {
		return recvErr
	}
	return err
}

// Upload stores a program (a .py file or a zip, told apart by filename) and returns its id, the sha256.
func (c *Client) Upload(ctx context.Context, program []byte, filename, tag string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 4*c.Timeout)
	defer cancel()
	digest := sha256.Sum256(program)
	want := hex.EncodeToString(digest[:])
	stream, err := c.stub.UploadProgram(ctx)
	if err != nil {
		return "", c.fail("upload", err)
	}
	header := &l4mv1.ProgramHeader{SizeBytes: uint64(len(program)), Sha256: want, Tag: tag, Filename: filename}
	if err := stream.Send(&l4mv1.UploadProgramRequest{Part: &l4mv1.UploadProgramRequest_Header{Header: header}}); err != nil {
		return "", c.fail("upload", uploadStatus(stream, err))
	}
	for start := 0; start < len(program); start += ChunkBytes {
		end := min(start+ChunkBytes, len(program))
		part := &l4mv1.UploadProgramRequest_Chunk{Chunk: program[start:end]}
		if err := stream.Send(&l4mv1.UploadProgramRequest{Part: part}); err != nil {
			return "", c.fail("upload", uploadStatus(stream, err))
		}
	}
	response, err := stream.CloseAndRecv()
	if err != nil {
		return "", c.fail("upload", err)
	}
	if response.Sha256 != want {
		return "", fmt.Errorf("the spawner stored %s, not the %s sent", response.Sha256, want)
	}
	return response.Sha256, nil
}

// UploadFile uploads the program at path.
func (c *Client) UploadFile(ctx context.Context, path, tag string) (string, error) {
	program, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	return c.Upload(ctx, program, filepath.Base(path), tag)
}

// Launch starts an instance of a stored program (id or "name:tag"); limits may be nil (the defaults).
func (c *Client) Launch(ctx context.Context, program string, args []string, limits *l4mv1.Limits) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	response, err := c.stub.Launch(ctx, &l4mv1.LaunchRequest{Program: program, Args: args, Limits: limits})
	if err != nil {
		return "", c.fail("launch", err)
	}
	return response.InstanceId, nil
}

// Attach calls onEvent for every event of the instance, from its start, one by one (the spawner sends
// the events that are ready together in one response, BatchEvents), and returns its exit.
// It has no deadline of its own: cancel ctx to stop watching.
func (c *Client) Attach(ctx context.Context, instanceID string, onEvent func(*l4mv1.AttachResponse)) (*l4mv1.InstanceExit, error) {
	stream, err := c.stub.Attach(ctx, &l4mv1.AttachRequest{InstanceId: instanceID, BatchEvents: true})
	if err != nil {
		return nil, c.fail("attach", err)
	}
	for {
		response, err := stream.Recv()
		if err == io.EOF {
			return nil, fmt.Errorf("the spawner ended the attach stream of %s without an exit event", instanceID)
		}
		if err != nil {
			return nil, c.fail("attach", err)
		}
		events := response.GetEvents()
		if len(events) == 0 {
			events = []*l4mv1.AttachResponse{response}
		}
		for _, event := range events {
			if onEvent != nil {
				onEvent(event)
			}
			if exit := event.GetExit(); exit != nil {
				return exit, nil
			}
		}
	}
}

// Send delivers a message to an instance.
func (c *Client) Send(ctx context.Context, instanceID, text string) error {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	_, err := c.stub.SendMessage(ctx, &l4mv1.SendMessageRequest{InstanceId: instanceID, Text: text})
	return c.fail("send", err)
}

// Terminate stops an instance; its exit reason becomes TERMINATED.
func (c *Client) Terminate(ctx context.Context, instanceID string) error {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	_, err := c.stub.Terminate(ctx, &l4mv1.TerminateRequest{InstanceId: instanceID})
	return c.fail("terminate", err)
}

// Run uploads the program at path, launches it with args and attaches until it exits (`l4m run`).
func (c *Client) Run(ctx context.Context, path string, args []string, onEvent func(*l4mv1.AttachResponse)) (*l4mv1.InstanceExit, error) {
	program, err := c.UploadFile(ctx, path, "")
	if err != nil {
		return nil, err
	}
	instanceID, err := c.Launch(ctx, program, args, nil)
	if err != nil {
		return nil, err
	}
	return c.Attach(ctx, instanceID, onEvent)
}

// ExitStatus is a process exit status for an instance's exit: its own code, 3 for a trap, 1 otherwise
// (the same rule as `l4m run`).
func ExitStatus(exit *l4mv1.InstanceExit) int {
	switch exit.GetReason() {
	case l4mv1.ExitReason_EXIT_REASON_EXITED:
		return int(exit.GetExitCode())
	case l4mv1.ExitReason_EXIT_REASON_TRAPPED:
		return 3
	}
	return 1
}

func (c *Client) fail(what string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s failed: %w -- is the spawner running at %s?", what, err, c.Address)
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}
