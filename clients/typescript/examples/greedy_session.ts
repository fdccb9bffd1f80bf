/**
 * Speak L4M directly, with no controller and no Python: chat prompt -> tokens -> KV pages ->
 * forward_text passes with a GREEDY sampler -> text. The same steps as the Python SDK's
 * `Context.fill_chat` + `generate(Greedy())`, so the answer is the same token for token.
 *
 *   node dist/examples/greedy_session.js --scheduler 127.0.0.1:7411 --max-tokens 16 "What is 2+2?"
 *
 * Prints the text as it is generated, then one JSON line {prompt_tokens, token_ids, text, stop} (the
 * summary the Python example text_completion.py sends). The scheduler must accept anonymous sessions
 * (`l4m up --allow-anonymous`) unless --token gives an instance token.
 */
import { parseArgs } from "node:util";

import { Template } from "@huggingface/jinja";
import { Tokenizer } from "@huggingface/tokenizers";

import { L4MSession } from "../src/index.js";
import { ForwardTextItem, ResourceKind, SamplerKind, SamplerSpec } from "../src/gen/l4m/v1/common.js";

/** A context's KV pages and what fills them: the LENGTH RULE's bookkeeping (docs/protocol.md). */
class KvPages {
  readonly pageIds: number[] = [];
  numSlots = 0;

  constructor(private readonly session: L4MSession, private readonly pageSize: number) {}

  /** Grow the pages to hold `numNewTokens` more slots (allocate first, then feed). */
  grow(numNewTokens: number): void {
    const numPagesNeeded = Math.ceil((this.numSlots + numNewTokens) / this.pageSize) - this.pageIds.length;
    if (numPagesNeeded <= 0) return;
    const ids = Array.from({ length: numPagesNeeded }, (_, i) => this.pageIds.length + i);
    this.session.send({ $case: "allocate", value: { kind: ResourceKind.RESOURCE_KIND_KV_PAGE, ids } });
    this.pageIds.push(...ids);
  }

  /** Feed tokens at the next positions and return the greedy next token after the last of them. */
  async forwardGreedy(tokenIds: number[]): Promise<number> {
    this.grow(tokenIds.length);
    const positionIds = tokenIds.map((_, i) => this.numSlots + i);
    this.numSlots += tokenIds.length;
    const reply = await this.session.request({
      $case: "forwardText",
      // fromPartial: fields added to the message later (l4m.v1 only ever adds) take their defaults.
      value: ForwardTextItem.fromPartial({
        kvPageIds: this.pageIds,
        kvLastPageLength: this.numSlots - this.pageSize * (this.pageIds.length - 1),
        tokenIds,
        positionIds,
        attentionMasks: [], // causal
        outputIndices: [tokenIds.length - 1],
        samplers: [SamplerSpec.fromPartial({ kind: SamplerKind.SAMPLER_KIND_GREEDY })],
      }),
    });
    if (reply.event?.$case !== "forwardText") throw new Error(`unexpected reply ${reply.event?.$case}`);
    const output = reply.event.value.outputs[0]?.result;
    if (output?.$case !== "token") throw new Error("a GREEDY sampler answers with a token");
    return output.value.tokenId;
  }
}

async function main(): Promise<void> {
  const { values, positionals } = parseArgs({
    options: {
      scheduler: { type: "string", default: "127.0.0.1:7411" },
      "max-tokens": { type: "string", default: "48" },
      token: { type: "string" },
    },
    allowPositionals: true,
  });
  const prompt = positionals[0] ?? "What is the capital of France?";
  const maxTokens = Number(values["max-tokens"]);
  const session = new L4MSession(values.scheduler!, values.token);
  try {
    const info = await session.getInfo();
    const model = info.model!;
    // The model's own tokenizer and chat template, as GetInfo ships them (HF tokenizers JSON, Jinja), and
    // the variables the template reads besides the messages (bos_token, eos_token).
    const tokenizer = new Tokenizer(JSON.parse(model.tokenizerJson), {});
    const text = new Template(model.chatTemplate).render({
      ...model.chatTemplateVariables,
      messages: [{ role: "user", content: prompt }],
      add_generation_prompt: true,
    });
    const promptIds = tokenizer.encode(text, { add_special_tokens: false }).ids;
    const stopIds = new Set(model.stopTokenIds);

    const pages = new KvPages(session, info.kvPageSize);
    const tokenIds: number[] = [];
    let stop = "length";
    let printed = "";
    let next = await pages.forwardGreedy(promptIds); // the whole prompt in one pass
    while (true) {
      tokenIds.push(next);
      const decoded = tokenizer.decode(tokenIds, { skip_special_tokens: true });
      if (!decoded.endsWith("\ufffd")) {
        process.stdout.write(decoded.slice(printed.length)); // a partial UTF-8 character waits
        printed = decoded;
      }
      if (stopIds.has(next)) {
        stop = "token";
        break;
      }
      if (tokenIds.length >= maxTokens) break;
      next = await pages.forwardGreedy([next]);
    }
    const completion = tokenizer.decode(tokenIds, { skip_special_tokens: true });
    process.stdout.write("\n");
    console.log(JSON.stringify({ prompt_tokens: promptIds.length, token_ids: tokenIds, text: completion, stop }));
  } finally {
    session.close();
  }
}

main().catch((error: Error) => {
  console.error(`l4m: ${error.message}`);
  process.exit(1);
});
