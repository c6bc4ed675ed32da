"""Jinja chat templates of the built-in models: ChatML (Qwen-style) and Llama-3-style headers."""

# Both templates accept system/user/assistant/tool messages, assistant `tool_calls` (OpenAI shape, with
# `arguments` as a JSON string or an object), a `tools` list and `add_generation_prompt`. Message content
# is expected to be a string (kvstrata.model.tokenizer.apply_chat_template flattens OpenAI content parts).

CHATML_TEMPLATE = """\
{%- set msgs = messages -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if msgs and msgs[0].role == 'system' -%}
        {{- msgs[0].content ~ '\\n\\n' -}}
        {%- set msgs = msgs[1:] -%}
    {%- endif -%}
    {{- '# Tools\\n\\nThe following functions are available. '
        'Their signatures are listed inside <tools></tools> tags:\\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' ~ (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object naming it and giving its arguments, '
        'inside <tool_call></tool_call> tags:\\n<tool_call>\\n'
        '{"name": "<function name>", "arguments": {"<arg>": "<value>"}}\\n</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- for message in msgs -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- if message.role == 'tool' -%}
        {%- if loop.first or msgs[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\\n<tool_response>\\n' ~ content ~ '\\n</tool_response>' -}}
        {%- if loop.last or msgs[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' ~ content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '<tool_call>\\n{"name": "' ~ fn.name ~ '", "arguments": ' -}}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' ~ message.role ~ '\\n' ~ content ~ '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

LLAMA3_TEMPLATE = """\
{{- bos_token -}}
{%- set msgs = messages -%}
{%- set system = '' -%}
{%- if msgs and msgs[0].role == 'system' -%}
    {%- set system = msgs[0].content if msgs[0].content is string else '' -%}
    {%- set msgs = msgs[1:] -%}
{%- endif -%}
{%- if system or tools -%}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' ~ (system | trim) -}}
    {%- if tools -%}
        {{- '\\n\\nYou can call these functions. To call one, reply with a JSON object '
            '{"name": function name, "parameters": arguments}.' -}}
        {%- for tool in tools -%}
            {{- '\\n\\n' ~ (tool | tojson(indent=4)) -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|eot_id|>' -}}
{%- endif -%}
{%- for message in msgs -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- if message.role in ['tool', 'ipython'] -%}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' ~ (content | trim) ~ '<|eot_id|>' -}}
    {%- elif message.role == 'assistant' and message.tool_calls -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {%- for call in message.tool_calls -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {{- '{"name": "' ~ fn.name ~ '", "parameters": ' -}}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson -}}
            {{- '}' -}}
        {%- endfor -%}
        {{- '<|eot_id|>' -}}
    {%- else -%}
        {{- '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\\n\\n' ~ (content | trim) ~ '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- endif -%}
"""
